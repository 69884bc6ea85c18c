"""Server plumbing every tokenmill process uses: health, reflection, and the one place that maps
exceptions to gRPC status codes.

    server = create_server()                       # installs ErrorStatusInterceptor
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health = add_health_and_reflection(server, [WORKER_SERVICE])
    port = server.add_insecure_port("0.0.0.0:50051")
    await server.start()
    ...warm up...
    await health.set_ready()                       # readiness flips to SERVING
    ...
    await health.enter_graceful_shutdown()         # everything NOT_SERVING, then server.stop(grace)
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import grpc
from grpc._cython import cygrpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from google.protobuf.message import DecodeError
from opentelemetry import trace

from core import errors
from plumbing import keepalive
from plumbing.handlers import behavior_of, with_behavior
from plumbing.telemetry import metrics
from plumbing.telemetry.span_policies import record_error

logger = logging.getLogger(__name__)

GENERATION_SERVICE = "tokenmill.v1.Generation"
SCHEDULER_SERVICE = "tokenmill.v1.Scheduler"
WORKER_SERVICE = "tokenmill.v1.Worker"

# Subclasses inherit their parent's code (status_for walks the MRO).
STATUS_CODES: dict[type[errors.ServingError], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.Cancelled: grpc.StatusCode.CANCELLED,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client should see for exc."""
    for cls in type(exc).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            return code, str(exc)
    if isinstance(exc, errors.ServingError):  # e.g. a downstream INTERNAL, already logged where it happened
        return grpc.StatusCode.INTERNAL, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):
        # A failed downstream call (gateway -> scheduler -> worker): pass its status through, so an
        # INVALID_ARGUMENT from the scheduler does not turn into INTERNAL at the gateway.
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def error_from_rpc_error(error: grpc.aio.AioRpcError, call: str = "") -> errors.ServingError:
    """A downstream call's status as the typed error it stands for (the inverse of status_for), so a
    client of an internal service handles kinds of failure, never status codes or message text. A
    status no ServingError stands for (UNKNOWN, INTERNAL, ...) becomes the base class, answered INTERNAL.
    call: what was called, e.g. "ExecuteStep on worker 10.0.0.5:50053"; given, the message is one line
    "CALL failed: CODE: details" (str(AioRpcError) is a multi-line dump, unfit for a client's error)."""
    code = errors.ErrorCode.__members__.get(error.code().name, errors.ErrorCode.INTERNAL)
    details = " ".join((error.details() or "").split())
    message = f"{call} failed: {error.code().name}: {details or '(no details)'}" if call else details
    typed = errors.error_from_code(code, message)
    typed.retry_after_s = retry_after_of(error)  # the server's "retry-after-ms" hint, passed on
    return typed


async def abort_with_status(context: grpc.aio.ServicerContext, exc: BaseException, method: str = "") -> None:
    """Ends the call with exc's status (always raises). Unexpected exceptions are logged in full."""
    code, message = status_for(exc)
    metrics.count_error(code.name)
    record_error(trace.get_current_span(), exc, code.name, with_traceback=code is grpc.StatusCode.INTERNAL)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("unexpected error in %s", method or "an RPC handler", exc_info=exc)
    else:
        logger.info("%s -> %s: %s", method or "RPC", code.name, message)
    retry_after_s = retry_after_of(exc)
    if retry_after_s is not None:
        context.set_trailing_metadata((("retry-after-ms", str(round(retry_after_s * 1000))),))
    await context.abort(code, message)


def retry_after_of(exc: BaseException) -> float | None:
    """Seconds a refused client should wait: the error's own hint, or the one a downstream server sent
    (so the scheduler's "queue full" hint reaches the gateway's client)."""
    if getattr(exc, "retry_after_s", None) is not None:
        return exc.retry_after_s  # type: ignore[attr-defined]
    if isinstance(exc, grpc.aio.AioRpcError):
        for key, value in exc.trailing_metadata() or ():
            if key == "retry-after-ms" and value.isdigit():
                return int(value) / 1000
    return None


async def _end_failed_call(context: grpc.aio.ServicerContext, exc: Exception, method: str) -> None:
    """abort_with_status, unless the caller cancelled the call first: the gateway closes a Submit once a
    stop string matched, or its client left, and a write still on its way then fails. Nobody is there to
    read a status, and the call did not fail for its caller, so it is neither an error span nor a counted
    error (the client side marks the same calls the same way: plumbing.telemetry.grpc_client)."""
    # a write on a call its caller already ended fails with cygrpc's ExecuteBatchError, while
    # context.cancelled() still reads False (grpc.aio marks the cancel only once the handler returns)
    if context.cancelled() or isinstance(exc, cygrpc.ExecuteBatchError):
        trace.get_current_span().set_attribute("tokenmill.rpc.cancelled_by_caller", True)
        logger.debug("%s: %s after its caller cancelled the call", method or "RPC", type(exc).__name__)
        return
    await abort_with_status(context, exc, method)


class ErrorStatusInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every async handler so a raised exception ends the call with status_for(exc).

    Handlers that already called context.abort (grpc.aio.AbortError) and cancelled calls
    (asyncio.CancelledError, a BaseException) pass through untouched.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return _wrap_handler(handler, handler_call_details.method)


def _wrap_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    behavior = behavior_of(handler)
    streaming_requests = bool(handler.stream_unary or handler.stream_stream)

    if inspect.isasyncgenfunction(behavior):

        async def wrapped(request: Any, context: grpc.aio.ServicerContext):
            try:
                async for response in behavior(_decoded(request, streaming_requests), context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001 - this is the one place that maps them
                await _end_failed_call(context, exc, method)

    elif inspect.iscoroutinefunction(behavior):

        async def wrapped(request: Any, context: grpc.aio.ServicerContext):
            try:
                return await behavior(_decoded(request, streaming_requests), context)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001
                await _end_failed_call(context, exc, method)

    else:
        # A synchronous handler runs on gRPC's thread pool where it cannot await context.abort;
        # tokenmill has none, so it is left as is rather than wrapped wrongly.
        return handler

    return with_behavior(handler, wrapped, request_deserializer=_tolerant(handler.request_deserializer))


class _Undecodable:
    """What a request that is not valid protobuf (or has invalid UTF-8 in a string) decodes to. gRPC
    would answer UNKNOWN naming a Python class; the wrapped handler raises INVALID_ARGUMENT instead."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def invalid_argument(self) -> errors.InvalidArgument:
        # protobuf's own reason names the message type and the fault ("String field had bad UTF-8", ...)
        return errors.InvalidArgument("request", "(undecodable bytes)", f"is not a valid protobuf message: {self.error}")


def _tolerant(deserializer):
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as error:
            return _Undecodable(error)

    return deserialize


def _decoded(request: Any, streaming: bool) -> Any:
    """The request, raising INVALID_ARGUMENT where it could not be decoded (per message for a stream)."""
    if isinstance(request, _Undecodable):
        raise request.invalid_argument()
    return _checked_stream(request) if streaming and hasattr(request, "__aiter__") else request


async def _checked_stream(requests):
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise request.invalid_argument()
        yield request


def create_server(
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Server:
    """A grpc.aio server with ErrorStatusInterceptor outermost, so it also maps errors raised by
    the other interceptors' wrappers, and keepalive on (plumbing.keepalive; options win)."""
    return grpc.aio.server(interceptors=[ErrorStatusInterceptor(), *interceptors],
                           options=keepalive.server_options(options))


class ReadinessHealthServicer(health_aio.HealthServicer):
    """grpc.health.v1 where service "" is liveness (SERVING as soon as the server answers) and each
    of our services is readiness: NOT_SERVING until the process calls set_ready() after warm-up."""

    def __init__(self, service_full_names: Iterable[str]) -> None:
        super().__init__()
        self.service_full_names = tuple(service_full_names)
        for name in self.service_full_names:
            # Nobody can watch yet (the server is not started), so setting the status map directly
            # is what the async set() would do, without needing a running event loop.
            self._server_status[name] = health_pb2.HealthCheckResponse.NOT_SERVING

    async def set_ready(self, ready: bool = True) -> None:
        """Readiness of every service this servicer was built with (ignored after graceful shutdown)."""
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.service_full_names:
            await self.set(name, status)


def add_health_and_reflection(server: grpc.aio.Server, service_full_names: Iterable[str],
                              reflection_on: bool = True) -> ReadinessHealthServicer:
    """Registers grpc.health.v1 and server reflection (listing our services, health and reflection;
    reflection_on=False: --no-reflection). Call before server.start(). The returned servicer's
    set_ready() flips readiness."""
    health = ReadinessHealthServicer(service_full_names)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    if reflection_on:
        reflection.enable_server_reflection(
            [*health.service_full_names, HEALTH_SERVICE, reflection.SERVICE_NAME], server
        )
    return health
