"""Installing tracing: the SDK tracer provider with its OTLP exporter, and our gRPC and Redis
instrumentation (plumbing.telemetry.tracing says when it is on and what the environment controls)."""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from opentelemetry import trace

from plumbing.telemetry.tracing import BACKGROUND_SWITCH, mark_installed, tracing_enabled, tracing_requested

logger = logging.getLogger("plumbing.telemetry.tracing")


def setup_tracing(service_name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Installs the SDK tracer provider with an OTLP/gRPC batch exporter, and instruments gRPC (aio
    servers and channels: W3C traceparent in the metadata) and Redis, if the environment asks for tracing. Returns whether it did.

    Call once, from a process's main, before any gRPC server or channel is created (the gRPC
    instrumentation wraps grpc.aio.server / insecure_channel as they are called)."""
    if tracing_enabled() or not tracing_requested(environ):
        return tracing_enabled()
    trace_background = environ.get(BACKGROUND_SWITCH, "").strip().lower() in ("1", "true")
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
    _instrument_libraries(provider, trace_background)
    mark_installed(trace_background)
    logger.info("tracing on: OTLP to %s as service %s",
                environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or "localhost:4317", provider.resource.attributes.get(SERVICE_NAME))
    return True


# Methods a process calls outside request work (plumbing.telemetry.tracing.background); a call to one
# that carries no traceparent starts no trace in the server either.
BACKGROUND_METHODS = frozenset({"GetModelInfo", "GetCapacity", "StreamDeltas"})


def _untraced_call_to(methods: frozenset[str]):
    def untraced(details) -> bool:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method.rsplit("/", 1)[-1] not in methods:
            return False
        return not any(key == "traceparent" for key, _ in (details.invocation_metadata or ()))

    return untraced


def _instrument_libraries(provider, trace_background: bool) -> None:
    from opentelemetry.instrumentation.grpc.filters import any_of, health_check, method_name, negate, service_prefix
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    from plumbing.telemetry.grpc_client import instrument_channels
    from plumbing.telemetry.grpc_server import instrument_servers
    from plumbing.telemetry.span_policies import RedisSpans

    # Health probes (the supervisor's, Kubernetes', the gateway waiting for its scheduler),
    # reflection and load polls would each start a trace of their own every poll: not request work,
    # left out. The server interceptor goes first in the chain, outside rpc.ErrorStatusInterceptor,
    # so the status that interceptor aborts with lands on the span.
    background = [health_check(), service_prefix("grpc.reflection")]
    if not trace_background:
        background.append(method_name("GetLoad"))
        # startup's model-info and capacity calls, and the gateway's lifetime StreamDeltas (a request
        # trace would hold it for minutes, as a failed call): traced only when a caller's trace comes with them
        background.append(_untraced_call_to(BACKGROUND_METHODS))
    instrument_servers(provider, negate(any_of(*background)))  # see grpc_server for why not the package's
    instrument_channels()  # our client side: see grpc_client for why not the package's
    # a Redis call is traced inside request or step work only: the health PING and the load report
    # heartbeat would be ~4 root traces a second per idle scheduler
    RedisInstrumentor().instrument(tracer_provider=RedisSpans(provider, child_spans_only=not trace_background))
