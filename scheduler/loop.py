"""The scheduler process's step loop on asyncio: the single owner of the Scheduler (invariant 4).

RPC handlers call submit() / abort(), which only check and enqueue; the loop task applies them at
the top of each iteration, runs schedule() -> await worker -> update(), and hands each request's
deltas to its stream queue. Request-state writes go to Redis through a batching writer that never
blocks this loop (invariant 6).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from core.errors import AlreadyExists, DeadlineExceeded, ServingError, WorkerUnavailable
from core.outputs import FinishReason, RequestOutput
from core.step import StepPlan, StepResult
from plumbing.process import cancel_and_wait
from scheduler.admission import Admission, AdmissionConfig
from scheduler.pipelined_loop import run_pipelined
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.worker_recovery import WorkerRecovery

logger = logging.getLogger(__name__)


class AsyncExecutor(Protocol):
    async def execute(self, plan: StepPlan) -> StepResult: ...


class StateSink(Protocol):
    """What the loop reports request transitions to (kvstore.RequestStateWriter in production)."""

    def queued(self, request_id: str, *, num_prompt_tokens: int | None = None, model: str | None = None,
               priority: int | None = None, created_at: float | None = None) -> None: ...
    def running(self, request_id: str) -> None: ...
    def preempted(self, request_id: str) -> None: ...
    def progress(self, request_id: str, *, num_output_tokens: int) -> None: ...
    def finished(self, request_id: str, *, finish_reason: FinishReason = FinishReason.STOP,
                 num_output_tokens: int | None = None) -> None: ...
    def failed(self, request_id: str, *, error: ServingError) -> None: ...
    def cancelled(self, request_id: str) -> None: ...


class TokenSink(Protocol):
    """Where resumable requests' tokens go (kvstore.TokenStreamWriter in production)."""

    def append(self, request_id: str, start_index: int, token_ids: list[int]) -> None: ...
    def finish(self, request_id: str, end_index: int, finish_reason: FinishReason, error: ServingError | None,
               num_prompt_tokens: int) -> None: ...


@dataclass(slots=True)
class RequestTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    first_token_forward_ns: int = 0  # the worker's time for the step that produced it
    finished: float | None = None


@dataclass(slots=True)
class RequestStream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    times: RequestTimes = field(default_factory=RequestTimes)


class EngineLoop:
    def __init__(self, scheduler: Scheduler, executor: AsyncExecutor, state: StateSink | None = None,
                 model_name: str = "", admission: Admission | None = None,
                 worker_recovery: WorkerRecovery | None = None, tokens: TokenSink | None = None,
                 async_scheduling: bool = False) -> None:
        self.scheduler = scheduler
        self.async_scheduling = async_scheduling  # plan step N+1 while N runs (scheduler/pipelined_loop.py)
        self.executor = executor
        # None: a failed step fails the requests it held (the executor cannot be reconnected)
        self.worker_recovery = worker_recovery
        self.tokens = tokens
        self._resumable: set[str] = set()  # ids whose tokens go to `tokens`, to outlive their caller
        self.state = state
        self.model_name = model_name
        config = scheduler.config  # without vocabulary knowledge only the ids' sign is checked
        self.admission = admission or Admission(AdmissionConfig(), vocab_size=2**32, max_model_len=config.max_model_len)
        self.streams: dict[str, RequestStream] = {}
        self._inbox: list[tuple[str, object]] = []
        self._deadlines: dict[str, float] = {}  # request id -> wall-clock deadline
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.num_steps = 0
        self.num_requests_total = 0  # accepted by submit(); published per replica (scheduler/load_report.py)

    # --- called by RPC handlers: check, enqueue, return -------------------------------------------

    def submit(self, request: Request, deadline: float | None = None, resumable: bool = False,
               owner: str | None = None) -> RequestStream:
        """deadline: wall-clock Unix seconds after which the request ends (pages freed) unfinished.
        resumable: its tokens also go to the token sink (ignored without one).
        owner: the API key name that submitted it, recorded for the gateways' by-id checks."""
        self.admission.check_request(request)
        if request.request_id in self.streams:
            raise AlreadyExists("request_id", request.request_id)
        self.scheduler.check_fits(request)
        arriving = [payload for kind, payload in self._inbox if kind == "add"]
        self.admission.check_room(request, len(self.scheduler.waiting) + len(arriving),
                                  lambda: self._waiting_tokens(arriving))
        stream = RequestStream()
        self.streams[request.request_id] = stream
        self.num_requests_total += 1
        if deadline is not None:
            self._deadlines[request.request_id] = deadline
        if resumable and self.tokens is not None:
            self._resumable.add(request.request_id)
        self._inbox.append(("add", request))
        if self.state:
            self.state.queued(request.request_id, num_prompt_tokens=request.num_prompt_tokens,
                              model=self.model_name, priority=request.priority, created_at=time.time(),
                              owner=owner)
        self._wakeup.set()
        return stream

    def _waiting_tokens(self, arriving: list[Request]) -> int:
        """Tokens still to compute over the waiting requests: in the scheduler's queue or the inbox."""
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.waiting)
        return waiting + sum(r.num_tokens for r in arriving)

    def abort(self, request_id: str, finish_reason: FinishReason = FinishReason.ABORT) -> bool:
        """Ends the request at the next loop iteration; False if it is unknown or already ended."""
        if request_id not in self.streams:
            return False
        self._inbox.append(("abort", (request_id, finish_reason)))
        self._wakeup.set()
        return True

    def wake(self) -> None:
        """Runs an iteration now (the loop sleeps while it has no requests)."""
        self._wakeup.set()

    # --- the loop ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name="engine-loop")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    async def run(self) -> None:
        if self.async_scheduling:
            return await run_pipelined(self)
        while True:
            if self.worker_recovery is not None and self.worker_recovery.lost:
                await self.worker_recovery.recover(self, "the connection to the worker broke", step_failed=False)
            self._apply_inbox()
            if not self.scheduler.has_unfinished():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            plan = self.scheduler.schedule()
            if plan.is_empty:
                await asyncio.sleep(0.001)
                continue
            self._note_scheduled(plan)
            try:
                result = await self.executor.execute(plan)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the worker is gone or broke
                if self.worker_recovery is None:
                    self._fail_all(WorkerUnavailable(f"worker unavailable: step failed: {error}"))
                else:
                    await self.worker_recovery.recover(self, error)
                continue
            if self.worker_recovery is not None:
                self.worker_recovery.step_succeeded()
            self.num_steps += 1
            self._deliver(self.scheduler.update(plan, result), result.forward_ns)
            await asyncio.sleep(0)  # let handlers enqueue between steps

    def _apply_inbox(self) -> None:
        self._expire_deadlines()
        inbox, self._inbox = self._inbox, []
        for kind, payload in inbox:
            if kind == "add":
                try:
                    self.scheduler.add_request(payload)
                except ServingError as error:  # too large for the KV cache, or the id is taken
                    self._end_stream(RequestOutput(payload.request_id, finished=True,
                                                   finish_reason=FinishReason.ERROR, error=error))
            else:
                request_id, finish_reason = payload
                output = self.scheduler.abort_request(request_id)
                if output is not None:
                    output.finish_reason = finish_reason
                    self._end_stream(output)

    def _expire_deadlines(self) -> None:
        if not self._deadlines:
            return
        now = time.time()
        for request_id in [rid for rid, deadline in self._deadlines.items() if deadline <= now]:
            del self._deadlines[request_id]
            output = self.scheduler.abort_request(request_id)
            if output is None:  # still in the inbox: never scheduled
                self._inbox = [(kind, p) for kind, p in self._inbox if not (kind == "add" and p.request_id == request_id)]
                output = RequestOutput(request_id, finished=True)
            output.finish_reason = FinishReason.ABORT
            output.error = DeadlineExceeded(f"request {request_id!r} passed its deadline after "
                                            f"{output.num_output_tokens} tokens; its pages are freed")
            self._end_stream(output)

    def _note_scheduled(self, plan: StepPlan) -> None:
        now = time.monotonic()
        for request_id in plan.finished_request_ids:
            request = self.scheduler.requests.get(request_id)
            if request is not None and self.state:  # dropped but alive: it was preempted
                self.state.preempted(request_id)
        for new in plan.new_requests:
            stream = self.streams.get(new.request_id)
            if stream and stream.times.first_scheduled is None:
                stream.times.first_scheduled = now
            if self.state:
                self.state.running(new.request_id)

    def _deliver(self, outputs: list[RequestOutput], forward_ns: int) -> None:
        now = time.monotonic()
        for output in outputs:
            stream = self.streams.get(output.request_id)
            if stream is None:
                continue
            if stream.times.first_token is None and output.new_token_ids:
                stream.times.first_token = now
                stream.times.first_token_forward_ns = forward_ns
            if output.finished:
                self._end_stream(output)
            else:
                if output.request_id in self._resumable:
                    self._write_tokens(output)
                stream.queue.put_nowait(output)

    def _end_stream(self, output: RequestOutput) -> None:
        stream = self.streams.pop(output.request_id, None)
        self._deadlines.pop(output.request_id, None)
        if stream is None:
            return
        stream.times.finished = time.monotonic()
        stream.queue.put_nowait(output)
        if output.request_id in self._resumable:
            self._resumable.discard(output.request_id)
            self._write_tokens(output)
        if not self.state:
            return
        if output.error is not None:
            self.state.failed(output.request_id, error=output.error)
        elif output.finish_reason is FinishReason.ABORT:
            self.state.cancelled(output.request_id)
        else:
            self.state.finished(output.request_id, finish_reason=output.finish_reason or FinishReason.STOP,
                                num_output_tokens=output.num_output_tokens)

    def _write_tokens(self, output: RequestOutput) -> None:
        end = output.num_output_tokens
        if output.new_token_ids:
            self.tokens.append(output.request_id, end - len(output.new_token_ids), output.new_token_ids)
        if output.finished:
            self.tokens.finish(output.request_id, end, output.finish_reason or FinishReason.ERROR, output.error,
                               output.num_prompt_tokens)

    def _fail_all(self, error: ServingError, request_ids: list[str] | None = None) -> None:
        """Ends the given requests (default: all) with finish reason error."""
        request_ids = list(self.scheduler.requests) if request_ids is None else request_ids
        logger.error("%s; failing %d requests", error, len(request_ids))
        for request_id in request_ids:
            output = self.scheduler.abort_request(request_id)
            if output is not None:
                output.finish_reason, output.error = FinishReason.ERROR, error
                self._end_stream(output)

