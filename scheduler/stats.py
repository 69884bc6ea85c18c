"""The scheduler's load figures: what GetLoad, the load report and the Prometheus collector read."""
from __future__ import annotations

from dataclasses import dataclass


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
    num_swapped_preemptions: int = 0  # of num_preemptions, those swapped to the host tier
    token_budget: int = 0  # of the latest step: max_num_batched_tokens, or what the latency target allowed
    step_time_error_s: float = 0.0  # observed - predicted time of the latest step (latency targets)
    itl_target_headroom: float = 0.8  # the share of target_itl_ms plans aim at (it follows the misses)
    num_itl_target_misses: int = 0  # steps whose time (planning to result) exceeded target_itl_ms, since start
    num_swapped: int = 0  # requests whose pages are in the host tier now (swapped out, waiting)
    num_host_blocks: int = 0  # pages of the host swap tier (0: no swap tier)
    num_used_host_blocks: int = 0
    # speculative decoding since start (scheduler.speculation; zeros without --speculative): verifying
    # steps of a request, draft tokens verified, of which accepted, and accepted at each draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
