"""Span status tells the truth, piece by piece (issue 38): a gRPC call its caller cancelled is no error,
a Redis NOSCRIPT reply (redis-py's EVALSHA-then-EVAL) is no error, an error status on a gRPC span comes
with the status code sent, and the gateway's lifetime delta stream is opened outside the request that
happens to open it. (Through real processes and a real receiver: test_span_status_e2e.)"""
from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from redis.exceptions import NoScriptError, ResponseError

from core.errors import DeadlineExceeded
from gateway.upstream.delta_stream import DeltaReader
from plumbing.telemetry.grpc_client import _end_span
from plumbing.telemetry.span_policies import RedisSpans, record_error


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


class FakeCall:
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    async def code(self):
        return self._code

    async def details(self):
        return self._details


@pytest.mark.parametrize(("code", "details", "error"), [
    (grpc.StatusCode.OK, "", False),
    (grpc.StatusCode.CANCELLED, "Locally cancelled by application!", False),  # the gateway stopped reading
    (grpc.StatusCode.CANCELLED, "Cancelled by the server", True),
    (grpc.StatusCode.UNAVAILABLE, "down", True),
])
def test_a_client_span_is_an_error_only_when_the_call_failed_for_its_caller(spans, code, details, error):
    provider, exporter = spans
    asyncio.run(_end_span(provider.get_tracer("t").start_span("/x.Y/Submit"), FakeCall(code, details)))
    (span,) = exporter.get_finished_spans()
    assert span.attributes["rpc.grpc.status_code"] == code.value[0]
    assert (span.status.status_code is StatusCode.ERROR) is error


def test_a_noscript_reply_is_no_error_and_a_real_error_is_recorded_once(spans):
    provider, exporter = spans
    tracer = RedisSpans(provider, child_spans_only=False).get_tracer("redis")
    with pytest.raises(NoScriptError), tracer.start_as_current_span("EVALSHA"):
        raise NoScriptError("No matching script. Please use EVAL.")
    with pytest.raises(ResponseError), tracer.start_as_current_span("HSET"):
        raise ResponseError("WRONGTYPE")
    noscript, failed = exporter.get_finished_spans()
    assert noscript.status.status_code is StatusCode.UNSET and not noscript.events
    assert noscript.attributes["tokenmill.redis.script_not_cached"] is True
    assert failed.status.status_code is StatusCode.ERROR
    (event,) = failed.events
    assert event.name == "exception" and "exception.stacktrace" not in event.attributes


def test_an_error_on_a_grpc_span_sets_the_status_code_it_ends_with(spans):
    """The server instrumentation starts rpc.grpc.status_code at 0 and changes it only on an abort: a
    call gRPC cut at its deadline read ERROR with 0."""
    provider, exporter = spans
    span = provider.get_tracer("t").start_span("/x.Y/Submit", attributes={"rpc.system": "grpc",
                                                                          "rpc.grpc.status_code": 0})
    record_error(span, DeadlineExceeded("cut"), "DEADLINE_EXCEEDED")
    span.end()
    other = provider.get_tracer("t").start_span("POST /v1/completions")
    record_error(other, DeadlineExceeded("cut"), "DEADLINE_EXCEEDED")
    other.end()
    grpc_span, http_span = exporter.get_finished_spans()
    assert grpc_span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "rpc.grpc.status_code" not in http_span.attributes


class RecordingStub:
    def __init__(self) -> None:
        self.span_at_call = None

    def StreamDeltas(self, request):  # noqa: N802 - the gRPC method's name
        self.span_at_call = trace.get_current_span()
        return EmptyStream()


class EmptyStream:
    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(3600)
        raise StopAsyncIteration

    def cancel(self) -> None:
        pass


def test_the_delta_stream_is_opened_outside_the_request_that_opens_it(spans):
    """It lives as long as the gateway: as a child of the first request it made that request a
    minutes-long failed trace."""
    provider, _ = spans
    stub = RecordingStub()

    async def first_request():
        reader = DeltaReader(stub, "scheduler:1")
        with provider.get_tracer("t").start_as_current_span("request") as request_span:
            assert reader.bind("r1", asyncio.Queue())
            assert trace.get_current_span() is request_span  # the request's own context is untouched
        reader._task.cancel()
        await asyncio.gather(reader._task, return_exceptions=True)

    asyncio.run(first_request())
    assert not stub.span_at_call.get_span_context().is_valid
