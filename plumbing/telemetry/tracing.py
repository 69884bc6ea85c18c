"""OpenTelemetry tracing set up from the standard OTEL_* environment, exporting OTLP over gRPC.

Tracing is on when OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT is set (or
OTEL_TRACES_EXPORTER=otlp, which falls back to the exporter's default localhost:4317), and
OTEL_SDK_DISABLED is not true and OTEL_TRACES_EXPORTER is not "none". Off, no SDK is installed: the
API's no-op tracer costs a function call per span and nothing is exported or printed.

Everything else is the SDK's own reading of the environment: OTEL_SERVICE_NAME (default: the
process's role, "gateway" / "scheduler" / "worker"), OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER(_ARG)
(default parentbased_always_on), OTEL_BSP_* (batch span processor), OTEL_EXPORTER_OTLP_* (headers,
TLS, timeout, compression).
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry import propagate, trace
from opentelemetry.trace import Link, SpanContext

logger = logging.getLogger(__name__)

TRACER_NAME = "tokenmill"
_enabled = False


def tracing_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces to be exported."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return bool(endpoint) or exporter == "otlp"


def setup_tracing(service_name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Installs the SDK tracer provider with an OTLP/gRPC batch exporter, and instruments gRPC (aio
    servers and channels: W3C traceparent in the metadata) and Redis, if the environment asks for tracing. Returns whether it did.

    Call once, from a process's main, before any gRPC server or channel is created (the gRPC
    instrumentation wraps grpc.aio.server / insecure_channel as they are called)."""
    global _enabled
    if _enabled or not tracing_requested(environ):
        return _enabled
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_NAMESPACE, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # attributes passed to Resource.create win over the environment's, so the role is passed only
    # when OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES name no service
    attributes = {SERVICE_NAMESPACE: "tokenmill"}
    if not environ.get("OTEL_SERVICE_NAME") and "service.name=" not in environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes[SERVICE_NAME] = service_name
    provider = TracerProvider(resource=Resource.create(attributes))  # sampler from OTEL_TRACES_SAMPLER
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _instrument_libraries()
    _enabled = True
    logger.info("tracing on: OTLP to %s as service %s",
                environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or "localhost:4317", provider.resource.attributes.get(SERVICE_NAME))
    return True


def _instrument_libraries() -> None:
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorServer
    from opentelemetry.instrumentation.grpc.filters import any_of, health_check, negate, service_prefix
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    from plumbing.telemetry.grpc_client import instrument_channels

    # Health probes (the supervisor's, Kubernetes', the gateway waiting for its scheduler) and
    # reflection would each start a trace of their own every poll: not request work, left out.
    # The server interceptor goes first in the chain, outside rpc.ErrorStatusInterceptor, so the
    # status that interceptor aborts with lands on the span.
    not_probes = negate(any_of(health_check(), service_prefix("grpc.reflection")))
    GrpcAioInstrumentorServer(filter_=not_probes).instrument()
    instrument_channels()  # our client side: see grpc_client for why not the package's
    RedisInstrumentor().instrument()


def tracing_enabled() -> bool:
    return _enabled


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
