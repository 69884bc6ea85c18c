"""The scheduler's one config object, built in main() (or a test) and passed down."""
from __future__ import annotations

from dataclasses import dataclass

KV_POLICIES = ("paged", "static")
SPECULATIVE_METHODS = ("ngram", "draft")  # scheduler.speculation's proposers
MAX_SPECULATIVE_TOKENS = 16  # --num-speculative-tokens' range is 1 .. this
QUEUE_POLICIES = ("fcfs", "priority")


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    num_blocks: int  # KV capacity in pages, as the worker reported it
    block_size: int = 16  # tokens per page
    max_num_seqs: int = 64  # most requests running at once
    max_num_batched_tokens: int = 512  # token budget of one step (prefill chunks + decode tokens)
    max_model_len: int = 2048  # prompt + output of one request
    kv_policy: str = "paged"  # "paged": pages on demand; "static": prompt + max_tokens reserved up front
    queue_policy: str = "fcfs"  # "fcfs" or "priority" (lower value runs first)
    enable_prefix_caching: bool = True  # paged policy only
    # the swap tier (worker --swap-space-gb): host pages a preempted request's K/V may move to
    num_host_blocks: int = 0
    bytes_per_block: int = 0  # K+V of one page, all layers (the worker's kv_cache_bytes / num_blocks)
    # host <-> device copy rate the swap cost assumes: pinned PCIe on a GPU, memcpy on a CPU, both
    # well above this; a slower guess only makes the scheduler recompute more often
    swap_bytes_per_s: float = 4e9
    # latency targets (scheduler.step_time): None keeps the fixed budgets above. With target_itl_ms each
    # step's token budget and the running-set size follow a learnt step-time model (max_num_batched_tokens
    # and max_num_seqs stay upper bounds); with target_ttft_ms a request close to missing it gets the
    # full budget for its prefill
    target_itl_ms: float | None = None
    target_ttft_ms: float | None = None
    # the window every layer of the model attends within (the worker's model config reports it; the
    # largest when layers differ), None when some layer attends the whole context. Set, a running
    # request's pages that hold only positions before its window go back to the pool (paged policy)
    sliding_window: int | None = None
    # speculative decoding (scheduler.speculation): "ngram" (prompt lookup), "draft" (the worker's draft
    # model) or None; up to
    # num_speculative_tokens drafts per request and step, verified by the worker in the same step
    speculative: str | None = None
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy={self.kv_policy!r} is not one of {KV_POLICIES}")
        if self.queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"queue_policy={self.queue_policy!r} is not one of {QUEUE_POLICIES}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a positive power of two")
        for name in ("num_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        for name in ("num_host_blocks", "bytes_per_block"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        for name in ("target_itl_ms", "target_ttft_ms", "sliding_window"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.speculative is not None:
            if self.speculative not in SPECULATIVE_METHODS:
                raise ValueError(f"speculative={self.speculative!r} is not one of {SPECULATIVE_METHODS}")
            if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens} must be in "
                                 f"1..{MAX_SPECULATIVE_TOKENS}")
        if self.swap_bytes_per_s <= 0:
            raise ValueError(f"swap_bytes_per_s={self.swap_bytes_per_s} must be positive")

    @property
    def prefix_caching(self) -> bool:
        return self.enable_prefix_caching and self.kv_policy == "paged"
