"""What the step pipeline sends plans to: anything that runs a step plan.

Executor runs it before returning (an in-process worker: scheduler.engine); AsyncExecutor returns an
awaitable (the gRPC worker client: scheduler.process.loop), so the loop can plan the next step meanwhile.
"""
from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from core.step import StepPlan, StepResult


class Executor(Protocol):
    block_size: int
    num_blocks: int  # KV capacity in pages, reported by the worker

    def execute(self, plan: StepPlan) -> StepResult: ...


class AsyncExecutor(Protocol):
    def execute(self, plan: StepPlan) -> Awaitable[StepResult]:
        """Starts sending the plan before it returns, where it can (the gRPC client creates its call), so
        the plan leaves at the loop's next yield; an `async def` also fits (it starts when first awaited)."""
