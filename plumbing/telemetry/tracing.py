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
    return trace.get_tracer(TRACER_NAME)


def shutdown_tracing() -> None:
    """Flushes spans still in the batch processor (a process calls it on its way out)."""
    provider = trace.get_tracer_provider()
    if _enabled and hasattr(provider, "shutdown"):
        provider.shutdown()


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
