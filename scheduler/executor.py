"""What the scheduler drives: anything that runs a step plan (an in-process worker or a gRPC client)."""
from __future__ import annotations

from typing import Protocol

from core.step import StepPlan, StepResult


class Executor(Protocol):
    block_size: int
    num_blocks: int  # KV capacity in pages, reported by the worker

    def execute(self, plan: StepPlan) -> StepResult: ...
