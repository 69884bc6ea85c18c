"""A request's telemetry in the scheduler: its time histograms (queue, prefill, decode, inference), how
it ended on its Submit (SERVER) span (finish reason, and tokenmill.finish_cause where the reason and
status do not say it all: client_disconnect, deadline, drained, worker_failed), and after the fact,
spans for the phases it went through, children of that span:

    scheduler.queue    arrival -> first scheduled
    scheduler.prefill  first scheduled -> first token (event gen_ai.first_token at its end)
    scheduler.decode   first token -> finished

They are made when the request ends (however it ends: finished, aborted, failed, its client gone),
from the times the step loop already keeps (scheduler.process.request_streams.RequestTimes), so the step loop
itself does no tracing work per request per token.

And one `scheduler.step` span per step (StepSpans), from sending its plan to delivering its outputs:
the ExecuteStep call is its child, and the Redis writes its delivery causes link to it. Its attributes
include the latency targets' decision (step_tuning_attributes): the token budget, the step-time
model's prediction, the step time observed (planning to result), the error, the ITL target that
governed the step and where it came from (the scheduler's flag, or a request's API key) and whether
it was missed.
"""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable

from opentelemetry import trace

from core.errors import DeadlineExceeded, DrainTimeout, ServingError, WorkerUnavailable
from core.outputs import FinishReason
from core.step import StepPlan, StepResult
from plumbing.telemetry import metrics
from plumbing.telemetry.logs import bind_request
from plumbing.telemetry.span_policies import record_error
from plumbing.telemetry.tracing import (current_traceparent, link_current_span, span_context_of, tracer,
                                        tracing_enabled)
from scheduler.step_time import StepTuning

__all__ = ["start_request", "link_cancelled", "record_request_end", "record_deadline_cut", "finish_cause",
           "StepSpans",
           "step_tuning_attributes", "CLIENT_DISCONNECT", "DEADLINE", "DRAINED", "WORKER_FAILED"]

logger = logging.getLogger("tokenmill.scheduler.requests")

# tokenmill.finish_cause: what ended a request when its finish reason and status do not say it all
CLIENT_DISCONNECT = "client_disconnect"  # the gateway dropped the Submit call
DEADLINE = "deadline"  # the request's deadline passed
DRAINED = "drained"  # this scheduler shut down and its drain timeout passed first
WORKER_FAILED = "worker_failed"  # the worker died or broke and the request could not be recovered


def finish_cause(error: ServingError | None) -> str:
    """The finish cause an error output stands for ("" when its status says it all)."""
    if isinstance(error, DeadlineExceeded):
        return DEADLINE
    if isinstance(error, DrainTimeout):
        return DRAINED
    if isinstance(error, WorkerUnavailable):
        return WORKER_FAILED
    return ""


def start_request(request_id: str) -> str:
    """Called as a Submit call starts: tags the call's log lines with the request id and returns the
    call's span as a traceparent ("" untraced), for the worker's step spans to link to."""
    bind_request(request_id)
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute("tokenmill.request_id", request_id)
    return current_traceparent()


def link_cancelled(requests) -> None:
    """On an Abort call's span: a link to each request it ended (scheduler.request.Request), so a cancel
    is found from the request it cancelled and the other way round."""
    if tracing_enabled():
        link_current_span([span_context_of(request.trace_context) for request in requests])


def record_request_end(times, num_preemptions: int = 0, finish_reason: FinishReason | None = None,
                       cause: str = "") -> None:
    """times: scheduler.process.request_streams.RequestTimes of a request that just ended (monotonic seconds);
    finish_reason / cause: how (cause: CLIENT_DISCONNECT, or "" when the reason says it all)."""
    end = times.finished if times.finished is not None else time.monotonic()
    _observe_times(times, end)
    span = trace.get_current_span()
    if not tracing_enabled() or not span.is_recording():
        return
    if finish_reason is not None:
        span.set_attribute("gen_ai.response.finish_reasons", [finish_reason.value])
    if cause:
        span.set_attribute("tokenmill.finish_cause", cause)
    # monotonic -> wall-clock nanoseconds (span times are Unix ns)
    offset_ns = time.time_ns() - time.monotonic_ns()

    def wall_ns(monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + offset_ns

    phases = (("scheduler.queue", times.arrival, times.first_scheduled or end),
              ("scheduler.prefill", times.first_scheduled, times.first_token or end),
              ("scheduler.decode", times.first_token, end))
    for name, start, stop in phases:
        if start is None:
            continue
        phase = tracer().start_span(name, start_time=wall_ns(start))
        if name == "scheduler.prefill" and times.first_token is not None:
            phase.add_event("gen_ai.first_token", timestamp=wall_ns(times.first_token),
                            attributes={"tokenmill.first_token_forward_ns": times.first_token_forward_ns})
        if name == "scheduler.decode" and num_preemptions:
            phase.set_attribute("tokenmill.num_preemptions", num_preemptions)
        phase.end(end_time=wall_ns(stop))


def record_deadline_cut(times, request_id: str) -> None:
    """gRPC cut the Submit call because its deadline passed (before the step loop ended the request
    for the same reason): no exception reaches the edge (plumbing.rpc), so its status, exception event,
    error count and log line are recorded here, as the edge would."""
    error = DeadlineExceeded(f"request {request_id!r} passed its deadline; the call was cut")
    record_request_end(times, finish_reason=FinishReason.ERROR, cause=DEADLINE)
    record_error(trace.get_current_span(), error, error.code.name)
    metrics.count_error(error.code.name)
    logger.info("Submit cut -> %s: %s", error.code.name, error)


def _observe_times(times, end: float) -> None:
    """vLLM's per-request time histograms (each only once the request reached that phase)."""
    model = metrics.model_name()
    if times.first_scheduled is None:
        return  # never scheduled: no queue time either (vLLM records these for scheduled requests)
    metrics.REQUEST_QUEUE_TIME.labels(model).observe(times.first_scheduled - times.arrival)
    metrics.REQUEST_INFERENCE_TIME.labels(model).observe(end - times.first_scheduled)
    if times.first_token is not None:
        metrics.REQUEST_PREFILL_TIME.labels(model).observe(times.first_token - times.first_scheduled)
        metrics.REQUEST_DECODE_TIME.labels(model).observe(end - times.first_token)


def step_tuning_attributes(tuning: StepTuning) -> dict[str, int | float | bool | str]:
    attributes: dict[str, int | float | bool | str] = {"tokenmill.step.token_budget": tuning.token_budget}
    if tuning.itl_target is not None:  # which target governed: the flag's, or a request's API key's
        attributes["tokenmill.step.itl_target_ms"] = tuning.itl_target.ms
        attributes["tokenmill.step.itl_target_source"] = tuning.itl_target.source
    if tuning.predicted_s is not None:
        attributes["tokenmill.step.predicted_ms"] = tuning.predicted_s * 1e3
    if tuning.observed_s is not None:
        attributes["tokenmill.step.observed_ms"] = tuning.observed_s * 1e3
        attributes["tokenmill.step.itl_target_missed"] = tuning.target_missed
        if tuning.predicted_s is not None:
            attributes["tokenmill.step.prediction_error_ms"] = (tuning.observed_s - tuning.predicted_s) * 1e3
    return attributes


class StepSpans:
    """`scheduler.step` spans, one per step in flight (two with async scheduling)."""

    def __init__(self) -> None:
        self._open: dict[int, trace.Span] = {}  # step id -> its span, from sending to delivery
        self._verifying: set[int] = set()  # open steps that verify draft tokens (speculative decoding)

    @contextlib.contextmanager
    def sending(self, plan: StepPlan):
        """Around sending the plan: the ExecuteStep call (and the state writes of its newly scheduled
        requests) happen under the step's span."""
        if not tracing_enabled():
            yield
            return
        span = tracer().start_span("scheduler.step", context=trace.set_span_in_context(trace.INVALID_SPAN),
                                   attributes={"tokenmill.step_id": plan.step_id,
                                               "tokenmill.step.num_requests": len(plan.num_scheduled_tokens),
                                               "tokenmill.step.num_tokens": plan.total_num_scheduled_tokens})
        if plan.spec_token_ids:  # speculative decoding: how many requests verify how many drafts
            self._verifying.add(plan.step_id)
            span.set_attributes({"tokenmill.step.num_speculating_requests": len(plan.spec_token_ids),
                                 "tokenmill.step.num_draft_tokens": sum(map(len, plan.spec_token_ids.values()))})
        self._open[plan.step_id] = span
        with trace.use_span(span, end_on_exit=False):
            yield

    @contextlib.contextmanager
    def delivering(self, step_id: int, tuning: Callable[[], StepTuning | None] = lambda: None,
                   result: StepResult | None = None):
        """Around handing the step's outputs to the request streams; ends the step's span with what the
        latency targets decided for it (tuning() is read after the outputs are applied) and, where it verified
        drafts, how many the worker accepted (result)."""
        span = self._open.pop(step_id, None)
        verified = step_id in self._verifying
        self._verifying.discard(step_id)
        if span is None:
            yield
            return
        if result is not None and verified:
            span.set_attribute("tokenmill.step.num_accepted_tokens", sum(map(len, result.accepted_token_ids.values())))
        with trace.use_span(span, end_on_exit=True):
            yield
            record = tuning()
            if record is not None:
                span.set_attributes(step_tuning_attributes(record))

    def abandon(self) -> None:
        """Ends the spans of steps whose results no longer count (the worker failed)."""
        for span in self._open.values():
            span.set_status(trace.Status(trace.StatusCode.ERROR, "step abandoned: the worker failed"))
            span.end()
        self._open.clear()
        self._verifying.clear()
