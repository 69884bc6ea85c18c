"""When the supervisor starts a crashed child again: exponential backoff, and a limit on how often.

    policy = RestartPolicy(backoff_initial_s=0.5, backoff_max_s=10, max_restarts=5, window_s=60)
    restarts = RestartHistory(policy)
    delay = restarts.next_delay(now)      # None: too many crashes in the window, give up

A child that crashes in a loop (a model file that went missing, a port taken) is given up after
max_restarts within window_s, so `tokenmill serve` exits with the child's last output instead of
restarting it forever; one that ran well for a window starts again from the shortest backoff.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    backoff_initial_s: float = 0.5  # wait before the first restart after a crash
    backoff_max_s: float = 10.0  # the backoff doubles per crash inside the window, up to this
    max_restarts: int = 5  # crashes tolerated inside window_s; one more and the child is given up
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.backoff_initial_s < 0 or self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(f"backoff_initial_s={self.backoff_initial_s} must be >= 0 and <= "
                             f"backoff_max_s={self.backoff_max_s}")
        if self.max_restarts < 0 or self.window_s <= 0:
            raise ValueError(f"max_restarts={self.max_restarts} must be >= 0 and window_s={self.window_s} > 0")


class RestartHistory:
    """The crashes of one child, to pick the next backoff (not thread-safe: one monitor owns it)."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._crashes: deque[float] = deque()  # monotonic times of recent crashes
        self.num_restarts = 0  # over the supervisor's life

    def next_delay(self, now: float) -> float | None:
        """Records a crash at now; the wait before restarting, or None to give up."""
        while self._crashes and now - self._crashes[0] > self.policy.window_s:
            self._crashes.popleft()
        if len(self._crashes) >= self.policy.max_restarts:
            return None
        self._crashes.append(now)
        self.num_restarts += 1
        exponent = len(self._crashes) - 1
        return min(self.policy.backoff_initial_s * 2**exponent, self.policy.backoff_max_s)
