"""The step loop: schedule() -> executor.execute(plan) -> update(). Three calls, one owner."""
from __future__ import annotations

from typing import Iterable

from scheduler.executor import Executor
from scheduler.outputs import RequestOutput
from scheduler.request import Request
from scheduler.scheduler import Scheduler


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        if scheduler.config.block_size != executor.block_size:
            raise ValueError(f"scheduler block_size={scheduler.config.block_size} differs from the "
                             f"worker's block_size={executor.block_size}")
        self.scheduler = scheduler
        self.executor = executor
        self.kv_utilization_samples: list[float] = []  # one per step, for benchmarks

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        result = self.executor.execute(plan)
        outputs = self.scheduler.update(plan, result)
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
