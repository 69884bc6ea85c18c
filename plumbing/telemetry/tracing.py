"""OpenTelemetry tracing set up from the standard OTEL_* environment, exporting OTLP over gRPC.

Tracing is on when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT is set (or
OTEL_TRACES_EXPORTER=otlp, which falls back to the exporter's default localhost:4317), and
OTEL_SDK_DISABLED is not true and OTEL_TRACES_EXPORTER is not "none". Off, no SDK is installed: the
API's no-op tracer costs a function call per span and nothing is exported or printed.

Everything else is the SDK's own reading of the environment: OTEL_SERVICE_NAME (default: the
process's role, "gateway" / "scheduler" / "worker"), OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG)
(default parentbased_always_on), OTEL_BSP_* (batch span processor), OTEL_EXPORTER_OTLP_* (headers,
TLS, timeout, compression).

Background calls (Redis health PINGs, load-report heartbeats, load polls, health checks) start no
trace of their own: they are traced only inside request or step work. TOKENMILL_TRACE_BACKGROUND=true
traces them too (for debugging the background itself).
"""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanContext

logger = logging.getLogger(__name__)

TRACER_NAME = "tokenmill"
BACKGROUND_SWITCH = "TOKENMILL_TRACE_BACKGROUND"
_enabled = False
_trace_background = False  # health pings, heartbeats, load polls as traces of their own (off by default)


def tracing_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces to be exported."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(endpoint) or exporter == "otlp"


def mark_installed(trace_background: bool) -> None:
    """Called once by plumbing.telemetry.tracing_setup after it installed the SDK and instrumented
    the libraries (kept apart from here: the instrumentation imports the gRPC client side, which
    imports this module's tracer)."""
    global _enabled, _trace_background
    _enabled, _trace_background = True, trace_background


def tracing_enabled() -> bool:
    return _enabled


def tracing_background() -> bool:
    """Whether background calls (health, heartbeats, load polls) may start traces of their own."""
    return _trace_background


def tracer() -> trace.Tracer:
    """tokenmill's tracer. Its spans record no `exception` event of their own when an exception leaves
    them: a failed request gets exactly one, on its request span, from record_error (a refusal used to
    get a second, with a stack of host paths, on the gateway.tokenize span it left through)."""
    return _NoExceptionEvents(trace.get_tracer(TRACER_NAME))


class _NoExceptionEvents:
    __slots__ = ("_tracer",)

    def __init__(self, tracer_: trace.Tracer) -> None:
        self._tracer = tracer_

    def start_as_current_span(self, *args, **kwargs):
        kwargs.setdefault("record_exception", False)
        return self._tracer.start_as_current_span(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tracer, name)


def shutdown_tracing() -> None:
    """Flushes spans still in the batch processor (a process calls it on its way out)."""
    provider = trace.get_tracer_provider()
    if _enabled and hasattr(provider, "shutdown"):
        provider.shutdown()


@contextlib.contextmanager
def background():
    """Calls made inside belong to no request: the span current here (a request that happened to
    open a connection-lifetime stream, say) is not their parent, so they start no trace (or traces of
    their own with TOKENMILL_TRACE_BACKGROUND=true). A task created inside keeps the empty context."""
    token = otel_context.attach(Context())
    try:
        yield
    finally:
        otel_context.detach(token)


# ---- carrying a span's identity through our own messages (step plans) ------------------------

def current_traceparent() -> str:
    """The current span as a W3C traceparent string, "" when tracing is off or there is no span."""
    if not _enabled:
        return ""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def link_to(traceparent: str) -> Link | None:
    """A span link to the span a traceparent string names; None for "" or a malformed one."""
    if not traceparent:
        return None
    span_context = trace.get_current_span(propagate.extract({"traceparent": traceparent})).get_span_context()
    return Link(span_context) if span_context.is_valid else None


def span_context_of(traceparent: str) -> SpanContext | None:
    link = link_to(traceparent)
    return link.context if link else None


class WriteCauses:
    """The spans (steps, requests) whose work queued the writes a background batch carries, so the
    batch's span links to them instead of being a trace nobody can place.

        causes.note()                                  # where a write is queued (cheap; no-op untraced)
        with causes.batch_span("kvstore.state.write"):  # around sending the batch
            await pipe.execute()                       # the Redis spans are its children
    """

    __slots__ = ("_contexts",)
    MAX_LINKS = 64

    def __init__(self) -> None:
        self._contexts: dict[int, SpanContext] = {}

    def note(self) -> None:
        if not _enabled:
            return
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid and len(self._contexts) < self.MAX_LINKS:
            self._contexts[span_context.span_id] = span_context

    def batch_span(self, name: str):
        """A root span linked to every cause noted since the last batch (no span when none was)."""
        contexts, self._contexts = self._contexts, {}
        if not contexts:
            return contextlib.nullcontext()
        return tracer().start_as_current_span(name, context=Context(), links=[Link(c) for c in contexts.values()],
                                              attributes={"tokenmill.batch.num_causes": len(contexts)})


CANCEL_LINK = {"tokenmill.link": "cancels"}  # a cancel's link to the request it cancelled


def link_current_span(span_contexts, attributes: Mapping[str, str] = CANCEL_LINK) -> None:
    """Links the current span to each span context (a cancel to the requests it ended), but not to a
    span of its own trace (a request that aborts itself when its client leaves)."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    own_trace = span.get_span_context().trace_id
    for span_context in span_contexts:
        if span_context is not None and span_context.is_valid and span_context.trace_id != own_trace:
            span.add_link(span_context, dict(attributes))


class RequestContexts:
    """The span each live request runs under, by request id, for a later call about it (a cancel) to
    link to. note() and forget() cost a dict operation when tracing is on, nothing when it is off."""

    __slots__ = ("_contexts",)

    def __init__(self) -> None:
        self._contexts: dict[str, SpanContext] = {}

    def note(self, request_id: str) -> None:
        if _enabled:
            span_context = trace.get_current_span().get_span_context()
            if span_context.is_valid:
                self._contexts[request_id] = span_context

    def forget(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)

    def link_current_span(self, request_ids) -> None:
        if self._contexts:
            link_current_span([self._contexts.get(request_id) for request_id in request_ids])
