"""Client side of W3C trace context over gRPC: a CLIENT span per call, its traceparent in the
call's metadata.

Ours rather than opentelemetry-instrumentation-grpc's aio client interceptors: theirs ends a
server-streaming call's span only when the caller iterates the stream to its very end, and the
gateway stops reading Submit at the finishing message (or cancels it), so the span was never ended
and never exported, leaving the scheduler's spans under a parent no trace store ever sees. Here the
span ends from the call's done callback, however the call ends. The server side is theirs
(GrpcAioInstrumentorServer), which works.
"""
from __future__ import annotations

import asyncio

import grpc
from grpc.aio import ClientCallDetails, Metadata
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from plumbing.telemetry.tracing import tracer, tracing_background

_UNTRACED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


def _start(details: ClientCallDetails) -> tuple[trace.Span, ClientCallDetails] | None:
    method = details.method.decode() if isinstance(details.method, bytes) else details.method
    if method.startswith(_UNTRACED_PREFIXES):  # probes poll; they are not request work
        return None
    parent = trace.get_current_span()
    parent_context = parent.get_span_context()
    if not parent_context.is_valid and not tracing_background():
        return None  # no request or step around it: a background call (load poll, registration)
    service, _, name = method.lstrip("/").partition("/")
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}
    if getattr(parent, "end_time", None) is not None:  # an SDK span that has ended
        # its parent has ended (an abort sent after the client went away): a span starting after its
        # parent's end would sit outside it in every trace view, so it starts a trace linked to it
        span = tracer().start_span(method, context=Context(), kind=SpanKind.CLIENT, attributes=attributes,
                                   links=[Link(parent_context)])
    else:
        span = tracer().start_span(method, kind=SpanKind.CLIENT, attributes=attributes)
    metadata = Metadata(*tuple(details.metadata or ()))
    propagate.inject(metadata, context=trace.set_span_in_context(span),
                     setter=_MetadataSetter())
    return span, ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                   details.wait_for_ready)


class _MetadataSetter:
    def set(self, carrier: Metadata, key: str, value: str) -> None:
        carrier[key] = value


# what grpc.aio's call.cancel() ends a call with (grpc.aio._call._LOCAL_CANCELLATION_DETAILS)
_CANCELLED_HERE = "Locally cancelled by application!"


async def _end_span(span: trace.Span, call) -> None:
    """Status ERROR only when the call failed for its caller: a call this process cancelled itself
    (the gateway stops reading Submit at the finishing message, or its client left) is no failure;
    its rpc.grpc.status_code is the CANCELLED it ended with, marked as the caller's own doing."""
    try:
        code = await call.code()
        details = await call.details() if code is grpc.StatusCode.CANCELLED else ""
    except asyncio.CancelledError:
        code, details = grpc.StatusCode.CANCELLED, _CANCELLED_HERE
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is grpc.StatusCode.CANCELLED and details == _CANCELLED_HERE:
        span.set_attribute("tokenmill.rpc.cancelled_by_caller", True)
    elif code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


def _end_when_done(span: trace.Span, call) -> None:
    call.add_done_callback(lambda done: asyncio.ensure_future(_end_span(span, done)))


async def _traced_call(continuation, client_call_details, request):
    """The call under a CLIENT span (traceparent in its metadata), ended when the call is done."""
    started = _start(client_call_details)
    if started is None:
        return await continuation(client_call_details, request)
    span, details = started
    call = await continuation(details, request)
    _end_when_done(span, call)
    return call


class UnaryUnaryTracing(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await _traced_call(continuation, client_call_details, request)


class UnaryStreamTracing(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await _traced_call(continuation, client_call_details, request)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """What every tokenmill channel gets when tracing is on (tokenmill makes unary-unary and
    server-streaming calls only)."""
    return [UnaryUnaryTracing(), UnaryStreamTracing()]


def instrument_channels() -> None:
    """Adds client_interceptors() to every grpc.aio channel this process creates from now on, the
    way GrpcAioInstrumentorClient does (so no call site needs to know whether tracing is on)."""
    original_insecure, original_secure = grpc.aio.insecure_channel, grpc.aio.secure_channel

    def insecure_channel(*args, interceptors=None, **kwargs):
        return original_insecure(*args, interceptors=[*client_interceptors(), *(interceptors or ())], **kwargs)

    def secure_channel(*args, interceptors=None, **kwargs):
        return original_secure(*args, interceptors=[*client_interceptors(), *(interceptors or ())], **kwargs)

    grpc.aio.insecure_channel, grpc.aio.secure_channel = insecure_channel, secure_channel
