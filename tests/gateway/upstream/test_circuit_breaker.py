"""The breaker's states on a hand-driven clock (no processes: it is a pure state machine; the e2e
scheduler-kill test in tests/e2e/test_faults.py drives it through a real gateway)."""
from __future__ import annotations

import pytest

from gateway.upstream.circuit_breaker import BreakerState, CircuitBreaker
from core.errors import Unavailable


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_then_fails_fast_until_the_probe_closes_it():
    clock = Clock()
    breaker = CircuitBreaker("scheduler at x", failure_threshold=3, open_s=2.0, clock=clock)
    for _ in range(2):
        assert breaker.before_call() is False
        breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    with pytest.raises(Unavailable, match=r"scheduler at x is unavailable: circuit open after 3 failures"):
        breaker.before_call()
    clock.now += 2.0
    assert breaker.before_call() is True  # the half-open probe
    with pytest.raises(Unavailable):
        breaker.before_call()  # one probe at a time
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.before_call() is False


def test_a_failed_probe_reopens_and_an_undecided_one_lets_the_next_call_probe():
    clock = Clock()
    breaker = CircuitBreaker("s", failure_threshold=1, open_s=1.0, clock=clock)
    breaker.record_failure()
    clock.now += 1.0
    assert breaker.before_call() is True
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    with pytest.raises(Unavailable):
        breaker.before_call()
    clock.now += 1.0
    assert breaker.before_call() is True
    breaker.release_probe()  # its client went away before any answer
    assert breaker.before_call() is True


def test_a_success_resets_the_failure_count():
    breaker = CircuitBreaker("s", failure_threshold=2)
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED


def test_can_call_answers_what_before_call_would_do_without_changing_anything():
    clock = Clock()
    breaker = CircuitBreaker("s", failure_threshold=1, open_s=1.0, clock=clock)
    assert breaker.can_call()
    breaker.record_failure()
    assert not breaker.can_call() and breaker.state is BreakerState.OPEN
    clock.now += 1.0
    assert breaker.can_call() and breaker.state is BreakerState.OPEN  # asking took no probe
    assert breaker.before_call()  # this one is the probe
    assert not breaker.can_call()  # while it is out, nobody else gets through
    breaker.record_success()
    assert breaker.can_call()


def test_on_open_is_called_once_per_opening_and_a_ready_peer_closes_it_at_once():
    clock = Clock()
    breaker = CircuitBreaker("s", failure_threshold=2, open_s=5.0, clock=clock)
    opened = []
    breaker.on_open = lambda: opened.append(clock.now)
    breaker.record_failure()
    breaker.record_failure()
    breaker.record_failure()  # already open: not reported again
    assert breaker.state is BreakerState.OPEN and opened == [100.0]
    breaker.record_ready()  # the scheduler's readiness check says SERVING, long before open_s ends
    assert breaker.state is BreakerState.CLOSED and breaker.before_call() is False
