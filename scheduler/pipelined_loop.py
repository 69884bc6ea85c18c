"""EngineLoop.run() with async scheduling: step N+1 is planned and sent while step N computes.

The worker receives step N+1's plan before it returns step N's tokens, so it goes from one forward
pass to the next without waiting for the scheduler's round trip (its reply, update(), schedule(),
the next request). At most two steps are in flight: the one computing and the one queued behind it.
The scheduler plans N+1 as if every request of N that samples had got one token
(Scheduler.assume_done) and applies N's real tokens when they come (Scheduler.update_assumed).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import TYPE_CHECKING

from core.errors import WorkerUnavailable

if TYPE_CHECKING:
    from scheduler.loop import EngineLoop

PIPELINE_DEPTH = 2  # steps sent to the worker and not yet applied


async def run_pipelined(loop: EngineLoop) -> None:
    scheduler = loop.scheduler
    in_flight: deque = deque()  # (plan, task awaiting its result), in step order
    try:
        while True:
            if loop.worker_recovery is not None and loop.worker_recovery.lost and not in_flight:
                await loop.worker_recovery.recover(loop, "the connection to the worker broke", step_failed=False)
            loop._apply_inbox()
            if not in_flight and not scheduler.has_unfinished():
                loop._wakeup.clear()
                await loop._wakeup.wait()
                continue
            plan = scheduler.schedule()
            if not plan.is_empty:
                loop._note_scheduled(plan)
                scheduler.assume_done(plan)
                in_flight.append((plan, asyncio.ensure_future(loop.executor.execute(plan))))
            if not in_flight:
                await asyncio.sleep(0.001)
                continue
            if len(in_flight) < PIPELINE_DEPTH and not plan.is_empty:
                await asyncio.sleep(0)  # let the plan go out, then plan the next one behind it
                continue
            done_plan, task = in_flight.popleft()
            try:
                result = await task
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the worker is gone or broke: the later step is lost too
                await _cancel(in_flight)
                if loop.worker_recovery is None:
                    loop._fail_all(WorkerUnavailable(f"worker unavailable: step failed: {error}"))
                else:
                    await loop.worker_recovery.recover(loop, error)
                continue
            if loop.worker_recovery is not None:
                loop.worker_recovery.step_succeeded()
            loop.num_steps += 1
            loop._deliver(scheduler.update_assumed(done_plan, result), result.forward_ns)
            await asyncio.sleep(0)  # let handlers enqueue between steps
    finally:
        await _cancel(in_flight)


async def _cancel(in_flight: deque) -> None:
    """Waits out (or cancels) the steps still in flight; their results no longer count."""
    while in_flight:
        _, task = in_flight.popleft()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
