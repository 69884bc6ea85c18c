"""Percentiles as the bench reports them and the scheduler's latency targets read them: linear between
the closest ranks (numpy's default), so a P99 means the same on both sides."""
from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default); None when empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} is out of range: must be in 0..100")
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
