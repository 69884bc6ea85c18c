"""What the scheduler loop does when its worker dies or breaks: WorkerRecovery decides, the loop acts.

The worker holds the KV cache, so a restarted worker (the supervisor or Kubernetes starts it again)
knows nothing of the requests in flight. The loop puts them back at the head of the queue with
num_computed_tokens = 0: the one scheduling rule then recomputes prompt + tokens generated so far
(exactly as after a preemption), and greedy output continues unchanged. With retry switched off, or
after too many failed steps in a row, they fail at once with a WorkerUnavailable error instead (the
servicer answers UNAVAILABLE).

Either way the loop then waits for a worker to answer again (re-registration: healthy, same page
size), asking wait_for_worker() once per attempt and applying submits, aborts and deadlines
between attempts; if none comes back within reconnect_timeout_s every request left fails, so nothing
waits forever. WorkerRecovery only decides and reconnects: it never touches the loop or the scheduler.

A restarted worker keeps its page count (worker.kv_sizing records the first start's sizing from
memory and a restart reuses it). Where the memory it needs is truly gone it comes back with fewer
pages: the RESUME decision carries the pages it reported, and the loop makes the scheduler adopt them
(Scheduler.adopt_worker_pages) before it plans again. Nothing holds a page then (every request was
re-queued for recompute), so no plan can name a page id the new worker lacks; only a request too large
for the smaller cache even alone fails, with RequestTooLarge.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from core.errors import WorkerUnavailable

logger = logging.getLogger(__name__)


class RecoveryAction(enum.Enum):
    REQUEUE = "requeue"  # the lost worker's requests go back to the queue to be recomputed
    FAIL_REQUEUED = "fail_requeued"  # ... and end at once with `error` (retry off, or it keeps failing)
    WAIT = "wait"  # the worker is not back yet: apply the inbox, then ask again
    RESUME = "resume"  # the worker is back and registered: schedule again
    FAIL_ALL = "fail_all"  # not back in time (or no recovery at all): every request left ends with `error`


@dataclass(slots=True, frozen=True)
class WorkerPages:
    """The KV pages a worker that came back reported (GetCapacity): the scheduler plans within them."""

    num_blocks: int  # device pages: every page id planned is below this
    num_host_blocks: int  # the swap tier's pages


@dataclass(slots=True, frozen=True)
class RecoveryDecision:
    action: RecoveryAction
    error: WorkerUnavailable | None = None  # set for the FAIL_* actions
    pages: WorkerPages | None = None  # RESUME: the pages of the worker that came back (None: not reported)


class WorkerRecovery:
    def __init__(self, reconnect: Callable[[float], Awaitable[WorkerPages | None]], *, retry: bool = True,
                 reconnect_timeout_s: float = 60.0, max_consecutive_failures: int = 3) -> None:
        """reconnect(timeout_s): returns the worker's pages once it is back and registered (None: it
        does not report them), raises otherwise."""
        self.reconnect = reconnect
        self.retry = retry
        self.reconnect_timeout_s = reconnect_timeout_s
        # a step that fails again right after a successful reconnect is not a lost worker but a
        # broken one (or a request that breaks it): stop re-queueing after this many in a row
        self.max_consecutive_failures = max_consecutive_failures
        self._consecutive_failures = 0
        self._away_since: float | None = None  # monotonic time of the loss being recovered from
        self.num_recoveries = 0
        self.lost = False  # set by notice_loss(); the loop recovers before its next step

    def notice_loss(self) -> None:
        """The connection to the worker broke (called from its watcher, on the loop's event loop)."""
        self.lost = True

    def step_succeeded(self) -> None:
        self._consecutive_failures = 0

    def after_loss(self, cause: BaseException | str, step_failed: bool = True) -> RecoveryDecision:
        """What to do with the lost worker's requests. cause: why; step_failed: a step raised (counted),
        rather than the watcher seeing the connection break. Starts the reconnect clock."""
        self.lost = False
        self._away_since = time.monotonic()
        self._consecutive_failures += int(step_failed)
        if self.retry and self._consecutive_failures <= self.max_consecutive_failures:
            logger.warning("worker lost (%s); its requests go back to the queue", cause)
            return RecoveryDecision(RecoveryAction.REQUEUE)
        why = "retry is off" if not self.retry else f"{self._consecutive_failures} failed steps in a row"
        return RecoveryDecision(RecoveryAction.FAIL_REQUEUED,
                                WorkerUnavailable(f"worker unavailable: step failed ({why}): {cause}"))

    async def wait_for_worker(self) -> RecoveryDecision:
        """One reconnect attempt (at most about a second): RESUME when the worker is back, WAIT when it
        is not yet, FAIL_ALL once reconnect_timeout_s has passed since after_loss()."""
        started = self._away_since if self._away_since is not None else time.monotonic()
        deadline = started + self.reconnect_timeout_s
        try:
            pages = await self.reconnect(min(1.0, max(deadline - time.monotonic(), 0.1)))
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure means "not back yet"
            if time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                return RecoveryDecision(RecoveryAction.WAIT)
            self._away_since = None
            return RecoveryDecision(RecoveryAction.FAIL_ALL, WorkerUnavailable(
                f"worker unavailable: not back after {self.reconnect_timeout_s:g}s: {error}"))
        self.num_recoveries += 1
        self.lost = False  # what the watcher saw while we waited is this same loss
        self._away_since = None
        logger.info("worker back after %.1fs", time.monotonic() - started)
        return RecoveryDecision(RecoveryAction.RESUME, pages=pages)
