"""What the scheduler loop does when a step fails because its worker died or broke.

The worker holds the KV cache, so a restarted worker (the supervisor or Kubernetes starts it again)
knows nothing of the requests in flight. The loop puts them back at the head of the queue with
num_computed_tokens = 0: the one scheduling rule then recomputes prompt + tokens generated so far
(exactly as after a preemption), and greedy output continues unchanged. With retry switched off they
fail at once with a WorkerUnavailable error instead (the servicer answers UNAVAILABLE).

Either way the loop then waits for a worker to answer again (re-registration: healthy, same KV
capacity), still applying submits, aborts and deadlines meanwhile, and fails what is left if none
comes back within reconnect_timeout_s, so nothing waits forever.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.loop import EngineLoop

from core.errors import WorkerUnavailable

logger = logging.getLogger(__name__)


class WorkerRecovery:
    def __init__(self, reconnect: Callable[[float], Awaitable[None]], *, retry: bool = True,
                 reconnect_timeout_s: float = 60.0, max_consecutive_failures: int = 3) -> None:
        """reconnect(timeout_s): returns once the worker is back and registered, raises otherwise."""
        self.reconnect = reconnect
        self.retry = retry
        self.reconnect_timeout_s = reconnect_timeout_s
        # a step that fails again right after a successful reconnect is not a lost worker but a
        # broken one (or a request that breaks it): stop re-queueing after this many in a row
        self.max_consecutive_failures = max_consecutive_failures
        self._consecutive_failures = 0
        self.num_recoveries = 0
        self.lost = False  # set by notice_loss(); the loop recovers before its next step

    def notice_loss(self) -> None:
        """The connection to the worker broke (called from its watcher, on the loop's event loop)."""
        self.lost = True

    def step_succeeded(self) -> None:
        self._consecutive_failures = 0

    async def recover(self, loop: EngineLoop, error: BaseException | str, step_failed: bool = True) -> None:
        """error: why; step_failed: a step raised (counted), rather than the watcher seeing the loss."""
        self.lost = False
        self._consecutive_failures += int(step_failed)
        requeued = loop.scheduler.requeue_after_worker_loss()
        if loop.state:
            for request_id in requeued:
                loop.state.preempted(request_id)
        if not self.retry or self._consecutive_failures > self.max_consecutive_failures:
            why = "retry is off" if self.retry is False else f"{self._consecutive_failures} failed steps in a row"
            loop._fail_all(WorkerUnavailable(f"worker unavailable: step failed ({why}): {error}"), requeued)
        else:
            logger.warning("worker step failed (%s); %d requests re-queued for recompute", error, len(requeued))
        await self._wait_for_worker(loop)

    async def _wait_for_worker(self, loop: EngineLoop) -> None:
        started = time.monotonic()
        deadline = started + self.reconnect_timeout_s
        while True:
            loop._apply_inbox()  # cancels and deadlines still apply while the worker is away
            try:
                await self.reconnect(min(1.0, max(deadline - time.monotonic(), 0.1)))
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - any failure means "not back yet"
                if time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    continue
                loop._fail_all(WorkerUnavailable(
                    f"worker unavailable: not back after {self.reconnect_timeout_s:g}s: {error}"))
                return
            self.num_recoveries += 1
            self.lost = False  # what the watcher saw while we waited is this same loss
            logger.info("worker back after %.1fs; %d requests to run", time.monotonic() - started,
                        len(loop.scheduler.requests))
            return
