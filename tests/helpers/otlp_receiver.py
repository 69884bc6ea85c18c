"""A tiny OTLP/gRPC trace receiver for tests: what an OpenTelemetry Collector does on :4317, keeping
every span it is sent in memory.

    with OtlpReceiver() as receiver:          # listens on a free port
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, ...}
        ...
        spans = receiver.wait_for(lambda spans: len(spans) >= 3, timeout_s=30)
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(slots=True)
class ReceivedSpan:
    service: str  # resource attribute service.name
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    attributes: dict
    events: list[str]
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace_id, span_id)
    status_code: int = 0  # opentelemetry.proto.trace.v1.Status.StatusCode: 0 unset, 1 ok, 2 error
    status_message: str = ""
    event_attributes: list[dict] = field(default_factory=list)  # one dict per event, in events' order
    start_ns: int = 0  # Unix nanoseconds
    end_ns: int = 0


def _value(any_value):
    which = any_value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, which) if which else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        service=resource.get("service.name", ""), name=span.name, trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(), parent_span_id=span.parent_span_id.hex(), kind=span.kind,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        events=[event.name for event in span.events],
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                        status_code=span.status.code, status_message=span.status.message,
                        event_attributes=[{a.key: _value(a.value) for a in event.attributes}
                                          for event in span.events],
                        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano))
        with self.receiver.lock:
            self.receiver.spans.extend(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._server)
        self.port = self._server.add_insecure_port(f"{host}:0")
        self.endpoint = f"http://{host}:{self.port}"

    def snapshot(self) -> list[ReceivedSpan]:
        with self.lock:
            return list(self.spans)

    def wait_for(self, condition, timeout_s: float = 60.0) -> list[ReceivedSpan]:
        """Polls until condition(spans) is true; returns the spans then (raises TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.snapshot()
            if condition(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise TimeoutError(f"spans never met the condition within {timeout_s:g}s; received: {names}")
            time.sleep(0.1)

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.stop(grace=None)
