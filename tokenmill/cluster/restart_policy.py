"""When the supervisor starts a crashed child again: exponential backoff, and when it is crash-looping.

    policy = RestartPolicy(backoff_initial_s=0.5, backoff_max_s=10, max_restarts=5, window_s=60)
    restarts = RestartHistory(policy)
    delay = restarts.record_crash(now, "exited with code 1")   # 0.5, 1, 2, 4, 8, then 10 s for ever
    restarts.state(now).crash_looping                         # True past max_restarts in the window

A crashed child is always started again: a supervisor never stops its healthy children because one of
them keeps dying (one hostile request that crashes the gateway must not take the workers down). Past
max_restarts crashes within window_s the child is *crash-looping*: it is restarted every backoff_max_s
and reported (RestartState, the supervisor's log) until it has gone a whole window_s without a crash.
A child that never became ready on its first start is not restarted at all: Supervisor.start() ends
with its output (a wrong model path, a taken port), see restart_monitor.py.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_initial_s: float = 0.5  # wait before the first restart after a crash
    backoff_max_s: float = 10.0  # the backoff doubles per crash inside the window, up to this
    max_restarts: int = 5  # crashes inside window_s at the doubling backoff; one more and it is crash-looping
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.backoff_initial_s < 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(f"backoff_initial_s={self.backoff_initial_s} must be >= 0 and <= "
                             f"backoff_max_s={self.backoff_max_s}")
        if self.max_restarts < 0 or self.window_s <= 0:
            raise ValueError(f"max_restarts={self.max_restarts} must be >= 0 and window_s={self.window_s} > 0")


@dataclass(frozen=True, slots=True)
class RestartState:
    """What a RestartHistory says about its child at one moment (for logs, tests and reports)."""

    num_restarts: int  # crashes restarted over the supervisor's life
    crashes_in_window: int  # crashes within the last window_s
    crash_looping: bool
    last_exit: str  # how it last crashed, "exited with code 1"; "" if it never did


class RestartHistory:
    """The crashes of one child, to pick the next backoff. The restart monitor writes it; state() may
    be read from any thread."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._crashes: deque[float] = deque()  # monotonic times of the crashes within the window
        self._num_restarts = 0
        self._crash_looping = False  # from the crash past max_restarts until a window without one
        self._last_exit = ""

    def record_crash(self, now: float, how: str = "") -> float:
        """Records a crash at now (how: the exit's description); the wait before restarting it."""
        with self._lock:
            self._forget_old(now)
            self._crashes.append(now)
            self._num_restarts += 1
            self._last_exit = how
            if len(self._crashes) > self.policy.max_restarts:
                self._crash_looping = True
            if self._crash_looping:
                return self.policy.backoff_max_s
            exponent = len(self._crashes) - 1
            return min(self.policy.backoff_initial_s * 2**exponent, self.policy.backoff_max_s)

    def recovered(self, now: float) -> bool:
        """True once, when a crash-looping child has gone window_s without crashing."""
        with self._lock:
            self._forget_old(now)
            if self._crash_looping and not self._crashes:
                self._crash_looping = False
                return True
            return False

    def state(self, now: float) -> RestartState:
        with self._lock:
            in_window = sum(1 for crashed_at in self._crashes if now - crashed_at <= self.policy.window_s)
            return RestartState(self._num_restarts, in_window, self._crash_looping, self._last_exit)

    def _forget_old(self, now: float) -> None:
        while self._crashes and now - self._crashes[0] > self.policy.window_s:
            self._crashes.popleft()
