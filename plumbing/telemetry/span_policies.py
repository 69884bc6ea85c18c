"""Tracer-provider wrappers that bend third-party instrumentations to what an operator can live with,
and the one way tokenmill records an error on a span.

    RedisInstrumentor().instrument(tracer_provider=RedisSpans(provider))
    GrpcAioInstrumentorServer(...).instrument(tracer_provider=OneExceptionEvent(provider))
    record_error(span, exc, "INVALID_ARGUMENT")

RedisSpans: ChildSpansOnly, and a NOSCRIPT reply (redis-py's Script sends EVALSHA first) is no error.

ChildSpansOnly: a span is made only under a live parent (request or step work); background calls
(health PINGs, heartbeats) would otherwise each be a root trace, ~4 a second per idle scheduler.

OneExceptionEvent: the gRPC server instrumentation records the AbortError our ErrorStatusInterceptor
raises, and the SDK records it again as it leaves the span: two events naming neither the real
error nor anything but absolute paths. Through this wrapper it records none; record_error (called
where the error is mapped to its status) records the real one, once. Nor does the instrumentation's
own status ("StatusCode.UNAVAILABLE:details", for server-side codes) replace record_error's
("UNAVAILABLE: details"), so every error status reads the same whatever its code.
"""
from __future__ import annotations

import contextlib
import re
import sys
import traceback

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Status, StatusCode

EXCEPTION_EVENT = "exception"
# 'File "/abs/path/site-packages/grpc/aio/_call.py"' -> 'File "grpc/aio/_call.py"'
_ROOTS = sorted({p.rstrip("/") + "/" for p in sys.path if p.startswith("/")}, key=len, reverse=True)
_FILE = re.compile(r'File "(/[^"]+)"')


def relative_traceback(exc: BaseException) -> str:
    """exc's traceback with each file named relative to the import root it came from (no host paths)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return _FILE.sub(lambda match: f'File "{_relative(match.group(1))}"', text)


def _relative(path: str) -> str:
    for root in _ROOTS:
        if path.startswith(root):
            return path[len(root):]
    return path.rsplit("/", 1)[-1]


def record_error(span: trace.Span, exc: BaseException, code: str, with_traceback: bool = False) -> None:
    """Status ERROR ("CODE: message"), error.type, and one `exception` event (a second call for the
    same span adds nothing). with_traceback: for unexpected errors; client-caused ones need none."""
    if not span.is_recording():
        return
    if any(event.name == EXCEPTION_EVENT for event in getattr(span, "events", ())):
        return
    message = str(exc)
    attributes = {"exception.type": type(exc).__name__, "exception.message": message}
    if with_traceback:
        attributes["exception.stacktrace"] = relative_traceback(exc)
    span.add_event(EXCEPTION_EVENT, attributes)
    span.set_attribute("error.type", code)
    _set_grpc_status_code(span, code)
    span.set_status(Status(StatusCode.ERROR, f"{code}: {message}"[:512]))


def _set_grpc_status_code(span, code: str) -> None:
    """On a gRPC span, rpc.grpc.status_code is the status the call ends with: the instrumentation sets it
    only when the handler aborts, so a call gRPC cut (its deadline passed) or one ended by a drain read 0
    beside an ERROR status."""
    if (getattr(span, "attributes", None) or {}).get("rpc.system") != "grpc":
        return
    import grpc

    status = grpc.StatusCode.__members__.get(code)
    if status is not None:
        span.set_attribute("rpc.grpc.status_code", status.value[0])


def _has_live_parent(context) -> bool:
    return trace.get_current_span(context).is_recording()


class _ChildSpansOnlyTracer:
    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def start_span(self, name, context=None, *args, **kwargs):
        if not _has_live_parent(context):
            return INVALID_SPAN
        return self._tracer.start_span(name, context, *args, **kwargs)

    @contextlib.contextmanager
    def start_as_current_span(self, name, context=None, *args, **kwargs):
        if not _has_live_parent(context):
            yield INVALID_SPAN
            return
        with self._tracer.start_as_current_span(name, context, *args, **kwargs) as span:
            yield span


class ChildSpansOnly:
    """A tracer provider whose tracers make no root spans (see the module docstring)."""

    def __init__(self, provider) -> None:
        self._provider = provider

    def get_tracer(self, *args, **kwargs):
        return _ChildSpansOnlyTracer(self._provider.get_tracer(*args, **kwargs))


class _RedisTracer:
    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def start_span(self, *args, **kwargs):
        return self._tracer.start_span(*args, **kwargs)

    @contextlib.contextmanager
    def start_as_current_span(self, *args, **kwargs):
        with self._tracer.start_as_current_span(*args, **{**kwargs, "record_exception": False,
                                                          "set_status_on_exception": False}) as span:
            try:
                yield span
            except Exception as exc:
                if _is_no_script(exc):  # redis-py's Script: EVALSHA first, EVAL on NOSCRIPT (the first call)
                    span.set_attribute("tokenmill.redis.script_not_cached", True)
                else:
                    record_error(span, exc, type(exc).__name__)
                raise


def _is_no_script(exc: BaseException) -> bool:
    from redis.exceptions import NoScriptError

    return isinstance(exc, NoScriptError)


class RedisSpans:
    """A tracer provider for the Redis instrumentation: the NOSCRIPT reply redis-py's Script answers by
    sending the script (a Script's first call on each connection's server) is no error; a real error is
    recorded once (record_error: status, error.type, one exception event, no stack). child_spans_only:
    see ChildSpansOnly."""

    def __init__(self, provider, child_spans_only: bool = True) -> None:
        self._provider = ChildSpansOnly(provider) if child_spans_only else provider

    def get_tracer(self, *args, **kwargs):
        return _RedisTracer(self._provider.get_tracer(*args, **kwargs))


class _SpanWithoutExceptionEvents:
    """Forwards everything to the span but record_exception (record_error does that, once) and a status
    that would replace the error status record_error set."""

    def __init__(self, span) -> None:
        self._span = span

    def record_exception(self, *args, **kwargs) -> None:
        pass

    def set_status(self, status, description=None) -> None:
        current = getattr(self._span, "status", None)
        if current is not None and current.status_code is StatusCode.ERROR:
            return
        self._span.set_status(status, description)

    def __getattr__(self, name):
        return getattr(self._span, name)


class _OneExceptionEventTracer:
    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def start_span(self, *args, **kwargs):
        return self._tracer.start_span(*args, **{**kwargs, "record_exception": False})

    @contextlib.contextmanager
    def start_as_current_span(self, *args, **kwargs):
        with self._tracer.start_as_current_span(*args, **{**kwargs, "record_exception": False}) as span:
            yield _SpanWithoutExceptionEvents(span)


class OneExceptionEvent:
    """A tracer provider whose spans record no exception events by themselves (module docstring)."""

    def __init__(self, provider) -> None:
        self._provider = provider

    def get_tracer(self, *args, **kwargs):
        return _OneExceptionEventTracer(self._provider.get_tracer(*args, **kwargs))
