"""The scheduler process's step loop on asyncio: the single owner of the Scheduler (invariant 4).

RPC handlers call submit() / abort(), which only check and put a typed item in the inbox; the loop
task applies the inbox at the top of each iteration, then drives the step pipeline
(scheduler.step_pipeline: schedule -> send to the worker -> apply the result, two steps deep by default)
and hands each request's deltas to its stream (scheduler.process.request_streams). When a result
comes, the next plan is sent before the step's deltas are handed out, so the worker never waits on
that hand-off:

    worker     | step N          | step N+1             | step N+2 ...
    scheduler  |   plan N+1 ->   |  apply N, plan N+2 -> |  apply N+1, plan N+3 ->
               |                 |  deliver N (streams, |  deliver N+1 ...
               |                 |  gateways, Redis)    | When a step fails, the
worker recovery decides what becomes of the requests it held and the loop carries that out.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from core.errors import AlreadyExists, DeadlineExceeded, ServingError, WorkerUnavailable
from core.outputs import FinishReason, RequestOutput
from core.step import StepPlan, StepResult
from plumbing.process import cancel_and_wait
from scheduler.admission import Admission, AdmissionConfig
from scheduler.executor import AsyncExecutor
from scheduler.process.inbox import AbortRequest, AddRequest, Inbox
from scheduler.request import Request
from scheduler.process.request_streams import RequestStream, RequestStreams, StateSink, TokenSink
from scheduler.scheduler import Scheduler
from scheduler.stats import SchedulerStats
from scheduler.process.telemetry import StepSpans
from scheduler.step_pipeline import StepPipeline, depth_for
from scheduler.process.worker_recovery import RecoveryAction, RecoveryDecision, WorkerPages, WorkerRecovery

logger = logging.getLogger(__name__)


class LiveSubmissions(Protocol):
    """Where resumable requests' submissions are kept while they run (scheduler.process.readmission)."""

    def admitted(self, request: Request, deadline: float | None, owner: str | None) -> asyncio.Future:
        """Keeps the submission; the future is done once it is kept (in Redis)."""


class EngineLoop:
    def __init__(self, scheduler: Scheduler, executor: AsyncExecutor, state: StateSink | None = None,
                 model_name: str = "", admission: Admission | None = None,
                 worker_recovery: WorkerRecovery | None = None, tokens: TokenSink | None = None,
                 async_scheduling: bool = True, live: LiveSubmissions | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.async_scheduling = async_scheduling  # plan step N+1 while N runs (pipeline depth 2)
        self.pipeline: StepPipeline[asyncio.Future] = StepPipeline(scheduler, depth_for(async_scheduling))
        # None: a failed step fails every request (the executor cannot be reconnected)
        self.worker_recovery = worker_recovery
        self.tokens = tokens
        # keeps each resumable request's submission until it ends, so a restarted scheduler re-admits
        # it (scheduler.process.readmission); None: a crash loses the requests
        self.live = live
        self.model_name = model_name
        config = scheduler.config  # without vocabulary knowledge only the ids' sign is checked
        self.admission = admission or Admission(AdmissionConfig(), vocab_size=2**32, max_model_len=config.max_model_len)
        self.streams = RequestStreams(state, tokens, model_name)
        self._inbox = Inbox()
        self.step_spans = StepSpans()  # scheduler.step spans: the ExecuteStep call and its Redis writes
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.num_steps = 0
        self.num_requests_total = 0  # accepted by submit(); published per replica (scheduler/process/load_report.py)

    # --- called by RPC handlers: check, enqueue, return -------------------------------------------

    def submit(self, request: Request, deadline: float | None = None, resumable: bool = False,
               owner: str | None = None, delta_stream_id: str = "") -> RequestStream:
        """deadline: wall-clock Unix seconds after which the request ends (pages freed) unfinished.
        resumable: its tokens also go to the token sink (ignored without one).
        owner: the API key name that submitted it, recorded for the gateways' by-id checks.
        delta_stream_id: its gateway's StreamDeltas call, for its deltas after the first (scheduler.process.delta_streams)."""
        self.admission.check_request(request)
        if request.request_id in self.streams:
            raise AlreadyExists("request_id", request.request_id)
        self.scheduler.check_fits(request)
        arriving = self._inbox.arriving()
        self.admission.check_room(request, len(self.scheduler.waiting) + len(arriving),
                                  lambda: self._waiting_tokens(arriving))
        # a resumable request's first output waits for its submission to be kept: a client must never see
        # a token of a request that a restarted scheduler would not re-admit (RequestStreams.deliver)
        keeps = resumable and self.live is not None and self.tokens is not None
        kept = self.live.admitted(request, deadline, owner) if keeps else None
        stream = self.streams.open(request, deadline, resumable, owner, delta_stream_id, kept=kept)
        self.num_requests_total += 1
        self._inbox.put(AddRequest(request))
        self._wakeup.set()
        return stream

    def stats(self) -> SchedulerStats:
        """The scheduler's figures with the requests still in the inbox counted as waiting: a step in
        flight leaves them there, and a scrape during it must still see them queued."""
        stats = self.scheduler.stats()
        stats.num_waiting += len(self._inbox.arriving())
        return stats

    def _waiting_tokens(self, arriving: list[Request]) -> int:
        """Tokens still to compute over the waiting requests: in the scheduler's queue or the inbox."""
        waiting = sum(r.num_tokens - r.num_computed_tokens for r in self.scheduler.waiting)
        return waiting + sum(r.num_tokens for r in arriving)

    def abort(self, request_id: str, finish_reason: FinishReason = FinishReason.ABORT) -> bool:
        """Ends the request at the next loop iteration; False if it is unknown or already ended."""
        if request_id not in self.streams:
            return False
        self.streams.abort_requested(request_id, finish_reason)
        self._inbox.put(AbortRequest(request_id, finish_reason))
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
        pipeline = self.pipeline
        try:
            while True:
                recovery = self.worker_recovery
                if recovery is not None and recovery.lost and not pipeline.num_in_flight:
                    await self._recover(recovery.after_loss("the connection to the worker broke", step_failed=False))
                self.apply_inbox()
                if not pipeline.has_work():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                sent = pipeline.send_next(self._send)
                step = pipeline.oldest_to_collect(sent)
                if step is None:  # nothing in flight (waiting for pages), or room to plan one more first
                    await asyncio.sleep(0 if sent is not None else 0.001)
                    continue
                try:
                    result = await step.pending
                except asyncio.CancelledError:
                    raise
                except Exception as error:  # noqa: BLE001 - the worker is gone or broke: later steps are lost too
                    await _cancel(pipeline.abandon())
                    self.step_spans.abandon()
                    await self._recover(self._decide_after_failed_step(error))
                    continue
                if recovery is not None:
                    recovery.step_succeeded()
                self.num_steps += 1
                await self._apply_then_send_then_deliver(step.plan.step_id, result)
        finally:
            await _cancel(pipeline.abandon())

    async def _apply_then_send_then_deliver(self, step_id: int, result: StepResult) -> None:
        """A step's result came. The next plan goes out before the step's outputs are handed to the
        request streams, the gateways' delta streams and the Redis writers' queues, so the worker gets
        it as soon as the scheduler's state allows (with async scheduling it is then two steps ahead,
        and delivering overlaps the step it runs; in the synchronous loop delivering overlaps the next
        step). The inbox is applied first, so requests that arrived while the step ran join that next
        plan, as they did when it was planned at the top of the loop; an abort found there ends its
        request before this step's token for it is applied, as one applied while the step ran does."""
        self.apply_inbox()
        outputs = self.pipeline.apply(result)
        self.pipeline.send_next(self._send)
        await asyncio.sleep(0)  # the plan's call goes out (and handlers may enqueue) before delivering
        with self.step_spans.delivering(step_id, lambda: self.scheduler.pop_step_tuning(step_id), result):
            self.streams.deliver(outputs, result.forward_ns)

    def apply_inbox(self) -> None:
        """Hands the handlers' adds and aborts to the scheduler and ends requests past their deadline:
        the top of every loop iteration (also while the worker is away)."""
        self._expire_deadlines()
        for item in self._inbox.take_all():
            if isinstance(item, AddRequest):
                try:
                    self.scheduler.add_request(item.request)
                except ServingError as error:  # too large for the KV cache, or the id is taken
                    self.streams.end(RequestOutput(item.request.request_id, finished=True,
                                                   finish_reason=FinishReason.ERROR, error=error))
            else:
                output = self.scheduler.abort_request(item.request_id)
                if output is not None:
                    output.finish_reason = item.finish_reason
                    self.streams.end(output)

    def _expire_deadlines(self) -> None:
        for request_id in self.streams.past_deadline():
            output = self.scheduler.abort_request(request_id)
            if output is None:  # still in the inbox: never scheduled
                self._inbox.withdraw(request_id)
                output = RequestOutput(request_id, finished=True)
            output.finish_reason = FinishReason.ABORT
            output.error = DeadlineExceeded(f"request {request_id!r} passed its deadline after "
                                            f"{output.num_output_tokens} tokens; its pages are freed")
            self.streams.end(output)

    def _send(self, plan: StepPlan) -> asyncio.Future:
        with self.step_spans.sending(plan):  # the task copies the context: its call is the step's child
            self.streams.scheduled(plan, self.scheduler.requests)
            return asyncio.ensure_future(self.executor.execute(plan))

    # --- a lost worker: the recovery decides, the loop acts ----------------------------------------

    def _decide_after_failed_step(self, error: Exception) -> RecoveryDecision:
        if self.worker_recovery is None:
            return RecoveryDecision(RecoveryAction.FAIL_ALL, WorkerUnavailable(f"worker unavailable: step failed: {error}"))
        return self.worker_recovery.after_loss(error)

    async def _recover(self, decision: RecoveryDecision) -> None:
        """Carries out the decision about the requests the lost worker held, then (with a recovery)
        waits for the worker, applying the inbox between reconnect attempts."""
        if decision.action is RecoveryAction.FAIL_ALL:
            self._fail(decision.error, list(self.scheduler.requests))
            return
        requeued = self.scheduler.requeue_after_worker_loss()
        self.streams.preempted(requeued)
        if decision.action is RecoveryAction.FAIL_REQUEUED:
            self._fail(decision.error, requeued)
        else:
            logger.warning("%d requests re-queued for recompute", len(requeued))
        while decision.action is not RecoveryAction.RESUME:
            self.apply_inbox()  # cancels and deadlines still apply while the worker is away
            decision = await self.worker_recovery.wait_for_worker()
            if decision.action is RecoveryAction.FAIL_ALL:
                self._fail(decision.error, list(self.scheduler.requests))
                return
        if decision.pages is not None:
            self._adopt_worker_pages(decision.pages)
        logger.info("worker back; %d requests to run", len(self.scheduler.requests))

    def _adopt_worker_pages(self, pages: WorkerPages) -> None:
        """Plans from now on stay within the pages the worker that came back has; a request that can no
        longer fit even alone ends with its RequestTooLarge error instead of waiting forever."""
        config = self.scheduler.config
        if (pages.num_blocks, pages.num_host_blocks) == (config.num_blocks, config.num_host_blocks):
            return
        logger.warning("the worker came back with %d KV pages (%d host pages); the scheduler had %d (%d): "
                       "adopting them", pages.num_blocks, pages.num_host_blocks, config.num_blocks,
                       config.num_host_blocks)
        for request_id, error in self.scheduler.adopt_worker_pages(pages.num_blocks, pages.num_host_blocks):
            self._fail(error, [request_id])

    def _fail(self, error: ServingError, request_ids: list[str]) -> None:
        """Ends the given requests with finish reason error."""
        logger.error("%s; failing %d requests", error, len(request_ids))
        for request_id in request_ids:
            output = self.scheduler.abort_request(request_id)
            if output is not None:
                output.finish_reason, output.error = FinishReason.ERROR, error
                self.streams.end(output)


async def _cancel(pending: list[asyncio.Future]) -> None:
    """Waits out (or cancels) steps whose results no longer count."""
    for future in pending:
        future.cancel()
        with contextlib.suppress(BaseException):
            await future
