"""The step loop's one rule: schedule() -> send the plan -> apply its result, with up to `depth` steps
in flight.

depth 1 is the synchronous loop: each step's result is applied before the next step is planned.
depth 2 is async scheduling: step N+1 is planned as if step N were done (Scheduler.assume_done) and
sent while N still runs, so the worker goes from one forward pass to the next without waiting for
the scheduler's round trip; N's real tokens are applied when they come (Scheduler.update_assumed),
in step order.

The pipeline does no I/O: its driver passes in how a plan is sent and awaits (or just takes) what
that returned. The in-process engine (scheduler.engine, a synchronous executor: "sending" runs the
step) and the scheduler service's asyncio loop (scheduler.process.loop, sending starts a task) both drive it,
so the rule of the loop exists once.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from core.outputs import RequestOutput
from core.step import StepPlan, StepResult
from scheduler.scheduler import Scheduler

Pending = TypeVar("Pending")  # what sending a plan returned: its result, or a task that will have it

SYNC, ASYNC_SCHEDULING = 1, 2  # the depths there are


def depth_for(async_scheduling: bool) -> int:
    return ASYNC_SCHEDULING if async_scheduling else SYNC


@dataclass(slots=True, frozen=True)
class InFlightStep(Generic[Pending]):
    plan: StepPlan
    pending: Pending


class StepPipeline(Generic[Pending]):
    def __init__(self, scheduler: Scheduler, depth: int = SYNC) -> None:
        if depth not in (SYNC, ASYNC_SCHEDULING):
            raise ValueError(f"pipeline depth={depth}: must be {SYNC} (sync) or {ASYNC_SCHEDULING} (async scheduling)")
        self.scheduler = scheduler
        # a draft model's guesses ride a step's result, so the next plan waits for it; the n-gram proposer's
        # requests sit out the steps they cannot be planned into (scheduler.speculation)
        speculation = scheduler.speculation
        self.depth = SYNC if speculation is not None and speculation.proposer.on_worker else depth
        self._in_flight: deque[InFlightStep[Pending]] = deque()  # sent and not applied, in step order

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    def send_next(self, send: Callable[[StepPlan], Pending]) -> StepPlan | None:
        """Plans the next step and sends it, if the pipeline has room and there is work to plan;
        returns the plan sent (None: nothing was)."""
        if len(self._in_flight) >= self.depth:
            return None
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return None
        if self.depth > SYNC:
            self.scheduler.assume_done(plan)  # so the next plan can go out before this result
        self._in_flight.append(InFlightStep(plan, send(plan)))
        return plan

    def oldest_to_collect(self, sent: StepPlan | None) -> InFlightStep[Pending] | None:
        """The step whose result the driver waits for now, or None: nothing in flight, or room for one
        more plan behind the one just sent (plan it first, so the worker has it queued)."""
        if not self._in_flight or (sent is not None and len(self._in_flight) < self.depth):
            return None
        return self._in_flight[0]

    def apply(self, result: StepResult) -> list[RequestOutput]:
        """Applies the oldest step's result (results come in step order); the requests' deltas."""
        step = self._in_flight.popleft()
        if self.depth > SYNC:
            return self.scheduler.update_assumed(step.plan, result)
        return self.scheduler.update(step.plan, result)

    def abandon(self) -> list[Pending]:
        """Forgets every step in flight (their worker is gone, or the loop stops); returns what their
        sending returned, for the driver to cancel. The requests' placeholders are the scheduler's to
        drop (requeue_after_worker_loss, abort_request)."""
        pending = [step.pending for step in self._in_flight]
        self._in_flight.clear()
        return pending
