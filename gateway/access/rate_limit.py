"""Per-API-key token buckets: each key may send `requests_per_s` on average and `burst` at once.

    limiter = RateLimiter(default_requests_per_s=10, default_burst=20)    # 0 / 0: no limit by default
    limiter.take(api_key)     # ResourceExhausted(retry_after_s=...) when the key's bucket is empty

Buckets live in this gateway process only: with N gateway replicas a key gets up to N times its rate,
which is the usual trade for not putting Redis on the request path (invariant 6).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from gateway.access.api_keys import ApiKey
from core.errors import ResourceExhausted

ANONYMOUS = ApiKey(name="anonymous", sha256="")  # every client, when no keys are configured


@dataclass(slots=True)
class TokenBucket:
    requests_per_s: float
    burst: int
    tokens: float
    updated: float  # time.monotonic() of the last refill

    def take(self, now: float) -> float:
        """Takes one token; returns 0 when it could, else the seconds until one will be there."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.requests_per_s)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.requests_per_s


class RateLimiter:
    def __init__(self, default_requests_per_s: float = 0.0, default_burst: int = 0) -> None:
        self.default_requests_per_s = default_requests_per_s  # 0: keys without their own limit are unlimited
        self.default_burst = default_burst  # 0: the rate, rounded up
        self._buckets: dict[str, TokenBucket] = {}

    def limits_for(self, key: ApiKey) -> tuple[float, int] | None:
        """(requests_per_s, burst) for key, or None when it is not limited."""
        rate = key.requests_per_s if key.requests_per_s is not None else self.default_requests_per_s
        if not rate:
            return None
        burst = key.burst if key.burst is not None else self.default_burst
        return rate, burst or max(1, round(rate + 0.499))

    def take(self, key: ApiKey, now: float | None = None) -> None:
        limits = self.limits_for(key)
        if limits is None:
            return
        now = time.monotonic() if now is None else now
        bucket = self._buckets.get(key.name)
        if bucket is None:
            bucket = self._buckets[key.name] = TokenBucket(*limits, tokens=float(limits[1]), updated=now)
        wait_s = bucket.take(now)
        if wait_s > 0:
            raise ResourceExhausted(
                f"rate limit of API key {key.name!r} exceeded: {limits[0]:g} requests/s, burst {limits[1]}; "
                f"retry in {wait_s:.2f} s", retry_after_s=wait_s)
