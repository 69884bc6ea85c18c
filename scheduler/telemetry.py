"""A request's telemetry in the scheduler: its queue time, and after the fact, spans for the phases
it went through, children of the request's Submit (SERVER) span:

    scheduler.queue    arrival -> first scheduled
    scheduler.prefill  first scheduled -> first token (event gen_ai.first_token at its end)
    scheduler.decode   first token -> finished

They are made when the request ends, from the times the step loop already keeps
(scheduler.request_streams.RequestTimes), so the step loop itself does no tracing work per request per token.
"""
from __future__ import annotations

import time

from opentelemetry import trace

from plumbing.telemetry import metrics
from plumbing.telemetry.logs import bind_request
from plumbing.telemetry.tracing import current_traceparent, tracer, tracing_enabled

__all__ = ["start_request", "record_request_end"]


def start_request(request_id: str) -> str:
    """Called as a Submit call starts: tags the call's log lines with the request id and returns the
    call's span as a traceparent ("" untraced), for the worker's step spans to link to."""
    bind_request(request_id)
    return current_traceparent()


def record_request_end(times, num_preemptions: int = 0) -> None:
    """times: scheduler.request_streams.RequestTimes of a request that just ended (monotonic seconds)."""
    if times.first_scheduled is not None:
        metrics.REQUEST_QUEUE_TIME.observe(times.first_scheduled - times.arrival)
    if not tracing_enabled() or not trace.get_current_span().is_recording():
        return
    # monotonic -> wall-clock nanoseconds (span times are Unix ns)
    offset_ns = time.time_ns() - time.monotonic_ns()

    def wall_ns(monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + offset_ns

    end = times.finished if times.finished is not None else time.monotonic()
    phases = (("scheduler.queue", times.arrival, times.first_scheduled or end),
              ("scheduler.prefill", times.first_scheduled, times.first_token or end),
              ("scheduler.decode", times.first_token, end))
    for name, start, stop in phases:
        if start is None:
            continue
        span = tracer().start_span(name, start_time=wall_ns(start))
        if name == "scheduler.prefill" and times.first_token is not None:
            span.add_event("gen_ai.first_token", timestamp=wall_ns(times.first_token),
                           attributes={"tokenmill.first_token_forward_ns": times.first_token_forward_ns})
        if name == "scheduler.decode" and num_preemptions:
            span.set_attribute("tokenmill.num_preemptions", num_preemptions)
        span.end(end_time=wall_ns(stop))
