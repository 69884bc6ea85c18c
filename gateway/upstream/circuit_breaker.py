"""A circuit breaker for the gateway -> scheduler hop.

closed     calls go through; failure_threshold consecutive UNAVAILABLE failures open it
open       calls fail at once with UNAVAILABLE (no connection attempt, no queueing) for open_s
half-open  after open_s one call goes through as a probe: success closes the breaker, failure
           opens it again for another open_s

Besides the probe, the peer's readiness check closes it (record_ready): the owner of the breaker
polls the peer's grpc.health.v1 readiness while it is open (on_open tells it when), so a restarted
scheduler takes every call as soon as it reports SERVING, instead of one probe at a time while the
others are refused.

While a scheduler is down its clients learn it in microseconds instead of each waiting on a dead
connection, and the gateway does not pile reconnect attempts onto a scheduler that is restarting.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Callable

from core.errors import Unavailable


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class CircuitBreaker:
    def __init__(self, name: str, failure_threshold: int = 3, open_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1 or open_s <= 0:
            raise ValueError(f"failure_threshold={failure_threshold} must be >= 1 and open_s={open_s} > 0")
        self.name = name  # named in the UNAVAILABLE message, e.g. "scheduler at 127.0.0.1:50052"
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self._clock = clock
        self.state = BreakerState.CLOSED
        self._failures = 0  # consecutive
        self._opened_at = 0.0
        self._probe_in_flight = False
        self.on_open: Callable[[], None] | None = None  # called each time it opens (not while open)

    def can_call(self) -> bool:
        """Whether before_call() would let a call through now (changes nothing): what a router asks
        before choosing this breaker's replica."""
        if self.state is BreakerState.CLOSED:
            return True
        return not self._probe_in_flight and (self.state is BreakerState.HALF_OPEN
                                              or self._clock() - self._opened_at >= self.open_s)

    def before_call(self) -> bool:
        """Raises Unavailable while open; returns True when this call is the half-open probe (its
        outcome must be reported through record_success / record_failure / release_probe)."""
        if self.state is BreakerState.CLOSED:
            return False
        waited = self._clock() - self._opened_at
        if self.state is BreakerState.OPEN and waited >= self.open_s:
            self.state = BreakerState.HALF_OPEN
        if self.state is BreakerState.HALF_OPEN and not self._probe_in_flight:
            self._probe_in_flight = True
            return True
        retry_in = max(self.open_s - waited, 0.0)
        raise Unavailable(f"{self.name} is unavailable: circuit open after {self._failures} failures in a row; "
                          f"next attempt in {retry_in:.1f}s")

    def record_success(self) -> None:
        self.state, self._failures, self._probe_in_flight = BreakerState.CLOSED, 0, False

    def record_ready(self) -> None:
        """The peer's readiness check reports SERVING: it is back, so calls go through again."""
        self.record_success()

    def record_failure(self) -> None:
        self._failures += 1
        self._probe_in_flight = False
        if self.state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            was_open = self.state is BreakerState.OPEN
            self.state, self._opened_at = BreakerState.OPEN, self._clock()
            if not was_open and self.on_open is not None:
                self.on_open()

    def release_probe(self) -> None:
        """The probe ended without telling either way (its client cancelled): the next call probes."""
        if self._probe_in_flight:
            self._probe_in_flight = False
            self.state, self._opened_at = BreakerState.OPEN, self._clock() - self.open_s
