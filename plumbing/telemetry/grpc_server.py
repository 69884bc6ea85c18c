"""Server side of W3C trace context over gRPC: opentelemetry-instrumentation-grpc's aio server
interceptor (a SERVER span per call, continuing the caller's traceparent), installed by us.

Why not GrpcAioInstrumentorServer as is: its interceptor drives every server-streaming handler with
`async for`, so a streaming handler written as a coroutine that sends with `context.write` (legal
in grpc.aio, and what a handler needs to put a timeout on a write to a client that stopped reading)
failed every traced call with UNKNOWN. Here such a handler is wrapped as the coroutine it is; the
span, its attributes and its status are the package's either way.
"""
from __future__ import annotations

import inspect

import grpc

from plumbing.telemetry.span_policies import OneExceptionEvent


def instrument_servers(provider, filter_) -> None:
    """Puts the tracing interceptor first on every grpc.aio server created from now on (outside
    plumbing.rpc.ErrorStatusInterceptor, so the status it aborts with lands on the span)."""
    from opentelemetry.instrumentation.grpc import __version__
    # the package's interceptor class; only its public behaviour (a ServerInterceptor) is relied on
    from opentelemetry.instrumentation.grpc._aio_server import OpenTelemetryAioServerInterceptor

    class TracingInterceptor(OpenTelemetryAioServerInterceptor):
        def _intercept_aio_server_stream(self, behavior, handler_call_details):
            if not inspect.isasyncgenfunction(behavior):  # writes with context.write, returns None
                return self._intercept_aio_server_unary(behavior, handler_call_details)
            return super()._intercept_aio_server_stream(behavior, handler_call_details)

    tracer = OneExceptionEvent(provider).get_tracer("opentelemetry.instrumentation.grpc", __version__,
                                                    schema_url="https://opentelemetry.io/schemas/1.11.0")
    original = grpc.aio.server

    def server(*args, interceptors=None, **kwargs):
        return original(*args, interceptors=[TracingInterceptor(tracer, filter_=filter_), *(interceptors or ())],
                        **kwargs)

    grpc.aio.server = server
