"""Swap or recompute: what a preempted request costs to bring back, decided per victim.

Recompute runs the victim's computed tokens through the model again; swap copies its pages to the
host tier and back (2 x pages x bytes per page over the copy rate). The cheaper one wins, when the
host tier has room. The recompute rate is learnt from the steps the worker ran (tokens / forward
time, a moving average); a prefill runs at least as many tokens per second as an average step, so
the estimate leans towards swap, whose cost is the smaller error on every machine we measured.
"""
from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.2  # weight of the newest step in the moving average


@dataclass(slots=True)
class RecomputeRate:
    tokens_per_s: float | None = None  # None until a timed step has run

    def observe(self, num_tokens: int, forward_ns: int) -> None:
        if num_tokens <= 0 or forward_ns <= 0:
            return  # untimed (a fake executor) or empty
        rate = num_tokens * 1e9 / forward_ns
        self.tokens_per_s = rate if self.tokens_per_s is None else (
            (1 - SMOOTHING) * self.tokens_per_s + SMOOTHING * rate)


def swap_is_cheaper(num_computed_tokens: int, num_pages: int, bytes_per_block: int, swap_bytes_per_s: float,
                    recompute: RecomputeRate) -> bool:
    """True when moving num_pages out and back costs less time than recomputing num_computed_tokens."""
    if recompute.tokens_per_s is None:
        return True  # nothing measured yet: the copy is bounded by memory bandwidth, recompute by compute
    swap_s = 2 * num_pages * bytes_per_block / swap_bytes_per_s
    return swap_s < num_computed_tokens / recompute.tokens_per_s
