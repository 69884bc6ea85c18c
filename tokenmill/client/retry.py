"""When the client sends a call again, and how long it waits first.

The rule: only UNAVAILABLE is retried (the server or the path to it is down, or the gateway could not
reach a scheduler), and only for calls that are safe to send twice:

- tokenize, detokenize, model_info, request_status: reads, always safe;
- cancel: cancelling twice leaves the request cancelled (the second answer may say cancelled=False);
- generate and stream: only while nothing has been received from the server. An UNAVAILABLE before
  the first message means the request never reached the gateway, or the gateway dropped it when the
  connection broke (it aborts a request whose caller went away, freeing its pages), so sending it
  again cannot produce two answers. Once a message has arrived, the error goes to the caller: the
  text so far would otherwise be repeated, or regenerated differently when sampling.

Waits grow exponentially (initial_backoff_s * multiplier**retry, at most max_backoff_s), each shortened
by a random fraction up to `jitter` so that many clients cut off together do not come back together.
No retry starts after the call's deadline: the timeout covers all attempts together.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import grpc

from tokenmill.client.types import ClientError

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 4  # 1: never retry
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.5  # each wait is cut by a random fraction in [0, jitter)
    rng: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts} must be >= 1")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.multiplier < 1:
            raise ValueError("backoffs must be >= 0 and the multiplier >= 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter={self.jitter} must be in [0, 1]")

    def backoff_s(self, retry: int) -> float:
        """The wait before retry number `retry` (0 for the first retry)."""
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** retry)
        return base * (1 - self.jitter * self.rng.random())

    def should_retry(self, code: grpc.StatusCode, attempt: int, received: bool) -> bool:
        """attempt: 1-based number of the attempt that failed; received: the server sent something."""
        return code in RETRYABLE_CODES and attempt < self.max_attempts and not received


NO_RETRY = RetryPolicy(max_attempts=1)


def deadline_after(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def time_left(deadline: float | None) -> float | None:
    """What is left for the next attempt (a sliver past the deadline, so gRPC reports DEADLINE_EXCEEDED)."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.001)


def wait_before_retry(policy: RetryPolicy, error: grpc.RpcError, attempt: int, received: bool,
                      deadline: float | None) -> float:
    """Seconds to wait before sending the call again; raises ClientError when it must not be retried
    (not UNAVAILABLE, attempts used up, something already received, or the wait would pass the deadline)."""
    if policy.should_retry(error.code(), attempt, received):  # type: ignore[attr-defined]
        wait = policy.backoff_s(attempt - 1)
        if deadline is None or time.monotonic() + wait < deadline:
            return wait
    raise ClientError.from_rpc_error(error, attempt) from None


class Attempts:
    """One call's attempts under a policy and one deadline for them all; both clients run their calls
    through one, and differ only in how they wait (time.sleep or asyncio.sleep).

        attempts = Attempts(policy, timeout_s)
        while True:
            try:
                return method(request, timeout=attempts.start())
            except grpc.RpcError as error:
                time.sleep(attempts.wait_s(error, received=False))
    """

    def __init__(self, policy: RetryPolicy, timeout_s: float | None) -> None:
        self.policy = policy
        self.deadline = deadline_after(timeout_s)
        self.number = 0  # of the attempt under way, from 1

    def start(self) -> float | None:
        """Counts a new attempt; returns its timeout, what is left of the deadline."""
        self.number += 1
        return time_left(self.deadline)

    def wait_s(self, error: grpc.RpcError, received: bool) -> float:
        """wait_before_retry for the attempt that just failed: raises ClientError when there is no retry."""
        return wait_before_retry(self.policy, error, self.number, received, self.deadline)
