"""Prepares and runs the worker's steps in step-id order, however their RPCs arrive.

With async scheduling the scheduler sends step N+1 while step N still runs (scheduler/step_pipeline.py).
Step N+1 is prepared (plan applied, batch packed, metadata built) on the RPC thread while step N
computes, then runs after step N on the compute thread (its decode rows read the tokens N samples).
Two RPCs on one channel may start their handlers in either order, so a step whose predecessor has
not been prepared yet waits for it (for at most wait_s: a predecessor whose RPC was cancelled never
comes).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

T = TypeVar("T")


class StepOrder:
    def __init__(self, wait_s: float = 5.0) -> None:
        self.wait_s = wait_s
        self._running = asyncio.Lock()  # FIFO: steps run in the order they were prepared
        self._prepared = asyncio.Condition()
        self.last_prepared: int | None = None  # step id; a lower one (a restarted scheduler) goes at once
        self.num_steps_queued = 0  # steps whose plan arrived while another step ran: pipelining at work

    @contextlib.asynccontextmanager
    async def turn(self, step_id: int, prepare: Callable[[], T]) -> AsyncIterator[T]:
        """Waits for the predecessor to be prepared, calls prepare(), then holds the run turn."""
        if self._running.locked():
            self.num_steps_queued += 1
        async with self._prepared:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._prepared.wait_for(lambda: self._may_prepare(step_id)), self.wait_s)
        try:
            prepared = prepare()
        except BaseException:  # a successor waits for this step to be prepared, or to have failed to be
            self.last_prepared = step_id
            async with self._prepared:
                self._prepared.notify_all()
            raise
        self.last_prepared = step_id
        # no await between here and queueing on the lock, so a successor woken below queues behind
        async with self._running:
            async with self._prepared:
                self._prepared.notify_all()
            yield prepared

    def _may_prepare(self, step_id: int) -> bool:
        return self.last_prepared is None or step_id <= self.last_prepared + 1
