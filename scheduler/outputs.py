"""What the scheduler hands back after each step: token deltas per request, and load figures."""
from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.plan import TokenLogprobs


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    error: str | None = None


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    num_blocks: int
    num_used_blocks: int
    kv_utilization: float  # live tokens / reserved slots of running requests
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int  # since start
    step_id: int
