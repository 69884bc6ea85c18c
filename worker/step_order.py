"""Runs the worker's steps one at a time, in step-id order, however their RPCs arrive.

With async scheduling the scheduler sends step N+1 while step N still runs (scheduler/pipelined_loop.py):
N+1 must run after N, since its decode rows read the tokens N samples. Two RPCs on one channel may
start their handlers in either order, so a step whose predecessor has not started yet waits for it
(for at most wait_s: a predecessor whose RPC was cancelled never comes).
"""
from __future__ import annotations

import asyncio
import contextlib


class StepOrder:
    def __init__(self, wait_s: float = 5.0) -> None:
        self.wait_s = wait_s
        self._running = asyncio.Lock()
        self._started = asyncio.Condition()
        self.last_started: int | None = None  # step id; a lower one (a restarted scheduler) runs at once
        self.num_steps_queued = 0  # steps whose plan arrived while another step ran: pipelining at work

    @contextlib.asynccontextmanager
    async def turn(self, step_id: int):
        if self._running.locked():
            self.num_steps_queued += 1
        async with self._started:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._started.wait_for(lambda: self._may_start(step_id)), self.wait_s)
        async with self._running:
            self.last_started = step_id
            async with self._started:
                self._started.notify_all()
            yield

    def _may_start(self, step_id: int) -> bool:
        return self.last_started is None or step_id <= self.last_started + 1
