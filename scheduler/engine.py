"""The step loop: schedule() -> executor.execute(plan) -> update(). Three calls, one owner.

With async_scheduling the loop is pipelined one step deep: step N+1 is planned (assume_done) and
handed to the executor before step N's result is applied (update_assumed). A synchronous executor
overlaps nothing; this is the offline form of what scheduler.pipelined_loop runs against a worker.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable

from scheduler.executor import Executor
from core.outputs import RequestOutput
from scheduler.request import Request
from scheduler.scheduler import Scheduler


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, async_scheduling: bool = False) -> None:
        if scheduler.config.block_size != executor.block_size:
            raise ValueError(f"scheduler block_size={scheduler.config.block_size} differs from the "
                             f"worker's block_size={executor.block_size}")
        self.scheduler = scheduler
        self.executor = executor
        self.kv_utilization_samples: list[float] = []  # one per step, for benchmarks
        self.async_scheduling = async_scheduling
        self._in_flight: deque = deque()  # (plan, result) whose result is not applied yet

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        return self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    def step(self) -> list[RequestOutput]:
        if self.async_scheduling:
            return self._step_ahead()
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        result = self.executor.execute(plan)
        outputs = self.scheduler.update(plan, result)
        self.kv_utilization_samples.append(self.scheduler.kv.utilization(self.scheduler.running))
        return outputs

    def _step_ahead(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan.is_empty:
            self.scheduler.assume_done(plan)
            self._in_flight.append((plan, self.executor.execute(plan)))
        if not self._in_flight or (len(self._in_flight) < 2 and not plan.is_empty):
            return []
        outputs = self.scheduler.update_assumed(*self._in_flight.popleft())
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
