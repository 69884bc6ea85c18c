"""Worker step telemetry: ONE span per step, linked to the requests in its batch, the step time
histogram by kind and the tokens-per-step histogram (vLLM's iteration tokens).

A step serves up to max_num_seqs requests, each from its own trace; a span per request per token
would flood the trace store. Instead each `worker.step` span carries a span link to every request it
ran (the request's scheduler span, whose W3C traceparent arrives once, in the plan's NewRequestData),
so a trace viewer goes from a request to the steps that computed it and back. The step span's own
parent is the scheduler's ExecuteStep call, in a trace per step.

So that the request's own trace also shows its time on the worker, each request gets one
`worker.prefill` span, a child of its scheduler span: from the start of the first step that held it
to the end of the step that sampled its first token, linked to that step's span (once per request,
again after a preemption, never per token).

    steps = StepTelemetry()
    with steps.step(plan) as step:        # around the forward pass of core.step.StepPlan
        step.result = runner.execute(plan)
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan

from core.step import StepPlan, StepResult
from plumbing.telemetry import metrics
from plumbing.telemetry.tracing import span_context_of, tracer, tracing_enabled


def step_kind(plan: StepPlan) -> str:
    """"decode" when every request computes one token of a sequence the worker already holds,
    "prefill" when none does, "mixed" otherwise."""
    new_ids = {new.request_id for new in plan.new_requests}
    decoding = sum(1 for request_id, num_tokens in plan.num_scheduled_tokens.items()
                   if num_tokens == 1 and request_id not in new_ids)
    if decoding == len(plan.num_scheduled_tokens):
        return "decode"
    return "prefill" if decoding == 0 else "mixed"


@dataclass(slots=True)
class StepRecord:
    result: StepResult | None = None  # set by the caller once the step has run


@dataclass(slots=True)
class _TracedRequest:
    span_context: trace.SpanContext  # the request's span in the scheduler
    prefill_start_ns: int | None  # wall-clock start of its first step; None once its first token is out


class StepTelemetry:
    def __init__(self) -> None:
        self._requests: dict[str, _TracedRequest] = {}  # while the worker holds the request

    @contextlib.contextmanager
    def step(self, plan: StepPlan):
        kind = step_kind(plan)
        record = StepRecord()
        step_time = metrics.WORKER_STEP_TIME.labels(metrics.model_name(), kind)
        metrics.ITERATION_TOKENS.labels(metrics.model_name()).observe(plan.total_num_scheduled_tokens)
        if not tracing_enabled():
            started = time.perf_counter()
            yield record
            step_time.observe(time.perf_counter() - started)
            return
        started_ns = time.time_ns()
        self._admit(plan, started_ns)
        links = [Link(traced.span_context) for request_id in plan.num_scheduled_tokens
                 if (traced := self._requests.get(request_id))]
        attributes = {"tokenmill.step_id": plan.step_id, "tokenmill.step.kind": kind,
                      "tokenmill.step.num_requests": len(plan.num_scheduled_tokens),
                      "tokenmill.step.num_tokens": plan.total_num_scheduled_tokens}
        with tracer().start_as_current_span("worker.step", links=links, attributes=attributes) as span:
            started = time.perf_counter()
            yield record
            step_time.observe(time.perf_counter() - started)
        if record.result is not None:
            self._end_prefills(record.result, Link(span.get_span_context()))

    def _admit(self, plan: StepPlan, now_ns: int) -> None:
        for request_id in plan.finished_request_ids:
            self._requests.pop(request_id, None)
        for new in plan.new_requests:  # first time, or again after a preemption
            span_context = span_context_of(new.trace_context)
            if span_context is not None:
                self._requests[new.request_id] = _TracedRequest(span_context, now_ns)

    def _end_prefills(self, result: StepResult, step_link: Link) -> None:
        now_ns = time.time_ns()
        for request_id in result.sampled_token_ids:
            traced = self._requests.get(request_id)
            if traced is None or traced.prefill_start_ns is None:
                continue
            parent = trace.set_span_in_context(NonRecordingSpan(traced.span_context))
            span = tracer().start_span("worker.prefill", context=parent, start_time=traced.prefill_start_ns,
                                       links=[step_link], attributes={"tokenmill.request_id": request_id})
            span.end(end_time=now_ns)
            traced.prefill_start_ns = None
