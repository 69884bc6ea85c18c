"""What the step pipeline sends plans to: anything that runs a step plan.

Executor runs it before returning (an in-process worker: scheduler.engine); AsyncExecutor returns an
awaitable (the gRPC worker client: scheduler.process.loop), so the loop can plan the next step meanwhile.
"""
from __future__ import annotations

from typing import Protocol

from core.step import StepPlan, StepResult


class Executor(Protocol):
    block_size: int
    num_blocks: int  # KV capacity in pages, reported by the worker

    def execute(self, plan: StepPlan) -> StepResult: ...


class AsyncExecutor(Protocol):
    async def execute(self, plan: StepPlan) -> StepResult: ...
