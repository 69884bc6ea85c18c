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
