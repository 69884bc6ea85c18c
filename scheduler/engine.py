"""The in-process engine: the step pipeline driven by a synchronous executor (tests, benchmarks,
`tokenmill generate`). Sending a plan runs the step, so a step's result exists as soon as its plan
does; with async scheduling the pipeline still plans step N+1 before applying N's tokens, which is
the offline form of what the scheduler service overlaps with a worker."""
from __future__ import annotations

from collections.abc import Iterable

from core.outputs import RequestOutput
from core.step import StepResult
from scheduler.executor import Executor
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.step_pipeline import StepPipeline, depth_for


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, async_scheduling: bool = True) -> None:
        if scheduler.config.block_size != executor.block_size:
            raise ValueError(f"scheduler block_size={scheduler.config.block_size} differs from the "
                             f"worker's block_size={executor.block_size}")
        self.scheduler = scheduler
        self.executor = executor  # replaceable between steps (a test swaps in a "restarted worker")
        self.async_scheduling = async_scheduling
        self.pipeline: StepPipeline[StepResult] = StepPipeline(scheduler, depth_for(async_scheduling))
        self.kv_utilization_samples: list[float] = []  # one per applied step, for benchmarks

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.pipeline.has_work()

    def step(self) -> list[RequestOutput]:
        sent = self.pipeline.send_next(lambda plan: self.executor.execute(plan))
        step = self.pipeline.oldest_to_collect(sent)
        if step is None:
            return []
        outputs = self.pipeline.apply(step.pending)
        self.kv_utilization_samples.append(self.scheduler.kv.utilization(self.scheduler.running))
        return outputs

    def run_to_completion(self, requests: Iterable[Request]) -> dict[str, list[RequestOutput]]:
        """Offline use: runs the given requests until all finish; outputs per request id."""
        results: dict[str, list[RequestOutput]] = {}
        for request in requests:
            self.add_request(request)
            results[request.request_id] = []
        while self.has_unfinished():
            for output in self.step():
                results.setdefault(output.request_id, []).append(output)
        return results
