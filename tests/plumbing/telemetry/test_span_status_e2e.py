"""Span status tells the truth (issue 38 items 1, 2 and the span gaps of 5), through real processes and
a real OTLP receiver: healthy requests on every API leave no ERROR span anywhere in their traces (the
gateway's Submit CLIENT span it cancels after the last message, Redis EVALSHA, StreamDeltas), no span of a
request outlives it by more than a flush, startup's scheduler calls start no trace, a refusal has one
exception event (on the request span, no stack), and a CancelRequest links to the request it cancels."""
from __future__ import annotations

import json
import threading
import time
import urllib.request

import grpc
import pytest

from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from tests.plumbing.telemetry.conftest import LONG_TOKENS, greedy_request, traceparent

pytestmark = pytest.mark.slow

SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
STATUS_ERROR = 2
FLUSH_NS = 1_000_000_000  # a span of the request may end this long after the request span (export batch)


def _grpc(config, tokens: int, streaming: bool) -> str:
    """A healthy traced tokenmill.v1 request, streamed or whole; its trace id."""
    trace_id, parent = traceparent()
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(
            prompt=f"healthy {'stream' if streaming else 'unary'}",
            parameters=generation_pb2.GenerateParameters(max_tokens=tokens, ignore_eos=True))
        metadata = [("traceparent", parent)]
        if streaming:
            messages = list(stub.GenerateStream(request, timeout=120, metadata=metadata))
            assert messages[-1].finish_reason
        else:
            stub.Generate(request, timeout=120, metadata=metadata)
    return trace_id


def grpc_stream(config, tokens: int = 5) -> str:
    return _grpc(config, tokens, streaming=True)


def grpc_unary(config, tokens: int = 4) -> str:
    return _grpc(config, tokens, streaming=False)


def http_completion(config, stream: bool, tokens: int = 4) -> str:
    trace_id, parent = traceparent()
    body = json.dumps({"model": "tiny-llama", "prompt": "healthy http", "max_tokens": tokens,
                       "stream": stream}).encode()
    request = urllib.request.Request(f"http://{config.http_address}/v1/completions", data=body, headers={
        "Content-Type": "application/json", "traceparent": parent})
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        response.read()
    return trace_id


def ended_traces(otlp_receiver, trace_ids: list[str]) -> list:
    """Every span of the traces once each trace's gateway and scheduler request spans have ended, plus
    half a second for the rest of the batch."""
    def ended(spans):
        done = {(s.trace_id, s.service) for s in spans if s.kind == SERVER and "gen_ai.response.finish_reasons"
                in s.attributes}
        return all({(t, "gateway"), (t, "scheduler")} <= done for t in trace_ids)

    otlp_receiver.wait_for(ended, timeout_s=90)
    time.sleep(1.0)
    return [s for s in otlp_receiver.snapshot() if s.trace_id in trace_ids]


def describe(spans) -> list:
    return sorted({(s.service, s.name, s.status_message, s.attributes.get("rpc.grpc.status_code")) for s in spans})


def test_healthy_requests_on_every_api_leave_no_error_span(traced_cluster, otlp_receiver):
    """12 healthy requests, some at once (the Submit CLIENT span was CANCELLED on about half)."""
    config, _ = traced_cluster
    started_ns = time.time_ns()
    trace_ids: list[str] = []
    calls = [lambda: grpc_stream(config), lambda: grpc_unary(config), lambda: http_completion(config, False),
             lambda: http_completion(config, True)] * 3
    threads = [threading.Thread(target=lambda call=call: trace_ids.append(call())) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(trace_ids) == len(calls)
    spans = ended_traces(otlp_receiver, trace_ids)
    # in the requests' traces and in the traces their work made (steps, batched Redis writes)
    errors = [s for s in otlp_receiver.snapshot() if s.start_ns >= started_ns and s.status_code == STATUS_ERROR]
    assert not errors, describe(errors)
    submits = [s for s in spans if s.name == "/tokenmill.v1.Scheduler/Submit" and s.kind == CLIENT]
    assert len(submits) == len(calls)
    redis = [s for s in spans if s.attributes.get("db.system") == "redis" or
             s.attributes.get("db.system.name") == "redis"]
    assert not [s for s in redis if s.status_code == STATUS_ERROR]
    for span in spans:  # a status code on a span is the code the call really ended with
        if "rpc.grpc.status_code" in span.attributes and span.attributes["rpc.grpc.status_code"] == 0:
            assert span.status_code != STATUS_ERROR


def test_no_span_of_a_request_outlives_it(traced_cluster, otlp_receiver):
    config, _ = traced_cluster
    trace_ids = [grpc_stream(config), http_completion(config, True)]
    spans = ended_traces(otlp_receiver, trace_ids)
    for trace_id in trace_ids:
        in_trace = [s for s in spans if s.trace_id == trace_id]
        (request,) = [s for s in in_trace if s.service == "gateway" and s.kind == SERVER]
        late = [s for s in in_trace if s.end_ns > request.end_ns + FLUSH_NS or s.start_ns < request.start_ns]
        assert not late, describe(late)
        assert not [s for s in in_trace if "StreamDeltas" in s.name]


def test_startup_calls_and_the_delta_stream_start_no_trace(traced_cluster, otlp_receiver):
    """The gateway's model-info call and the scheduler's capacity call at startup are background (as
    health and GetLoad), and the gateway's lifetime StreamDeltas is in no trace: no root span of theirs,
    nor any span of StreamDeltas (it used to sit in the first request's trace as a minutes-long error)."""
    config, _ = traced_cluster
    grpc_stream(config)  # a request, which opens the delta stream if none is open
    time.sleep(1.0)
    spans = otlp_receiver.snapshot()
    roots = sorted({s.name for s in spans if s.parent_span_id == "" and s.name.rsplit("/", 1)[-1]
                    in ("GetModelInfo", "GetCapacity", "StreamDeltas")})
    assert not roots
    assert not [s.name for s in spans if s.name.endswith("/StreamDeltas")]


def test_a_refusal_has_one_exception_event_on_its_request_span_and_no_stack(traced_cluster, otlp_receiver):
    config, _ = traced_cluster
    trace_id, parent = traceparent()
    with grpc.insecure_channel(config.gateway_address) as channel, pytest.raises(grpc.RpcError):
        generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(
            prompt="too many tokens", parameters=generation_pb2.GenerateParameters(max_tokens=10**6)),
            timeout=30, metadata=[("traceparent", parent)])
    otlp_receiver.wait_for(lambda spans: any(s.trace_id == trace_id and s.name == "gateway.tokenize" for s in spans))
    time.sleep(0.5)
    spans = [s for s in otlp_receiver.snapshot() if s.trace_id == trace_id]
    events = [(s.kind, attrs) for s in spans for name, attrs in zip(s.events, s.event_attributes)
              if name == "exception"]
    assert [kind for kind, _ in events] == [SERVER]  # one, on the request span (none on gateway.tokenize)
    assert "exception.stacktrace" not in events[0][1]  # a refusal is no unexpected error


def test_a_deadline_cut_span_reports_the_status_code_sent(traced_cluster, otlp_receiver):
    """gRPC cuts the call when its deadline passes: the server spans say ERROR, and their
    rpc.grpc.status_code is DEADLINE_EXCEEDED (4), not the 0 the instrumentation starts with."""
    config, _ = traced_cluster
    trace_id, parent = traceparent()
    with grpc.insecure_channel(config.gateway_address) as channel, pytest.raises(grpc.RpcError) as expired:
        for _ in generation_pb2_grpc.GenerationStub(channel).GenerateStream(generation_pb2.GenerateRequest(
                prompt="too slow", parameters=generation_pb2.GenerateParameters(
                    max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)),
                timeout=1.5, metadata=[("traceparent", parent)]):
            pass
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    def failed_services(spans):
        return {s.service for s in spans if s.trace_id == trace_id and s.kind == SERVER
                and s.status_code == STATUS_ERROR}

    spans = otlp_receiver.wait_for(lambda spans: failed_services(spans) >= {"gateway", "scheduler"})
    for span in [s for s in spans if s.trace_id == trace_id]:
        if span.status_code == STATUS_ERROR and "rpc.grpc.status_code" in span.attributes:
            code = span.attributes["rpc.grpc.status_code"]
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], describe([span])


def test_a_cancel_links_to_the_request_it_cancelled(traced_cluster, otlp_receiver):
    """CancelRequest runs in a trace of its own (the caller's): the gateway's CancelRequest span links to
    the request's span there, and the scheduler's Abort span to the request's Submit span."""
    config, _ = traced_cluster
    trace_id, parent = traceparent()
    cancel_trace, cancel_parent = traceparent()
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.GenerateStream(greedy_request("cancel-linked", "cancel me", 400),
            timeout=120, metadata=[("traceparent", parent)])
        next(call)
        assert stub.CancelRequest(generation_pb2.CancelRequestRequest(request_id="cancel-linked"), timeout=30,
                                  metadata=[("traceparent", cancel_parent)]).cancelled
        list(call)
    spans = ended_traces(otlp_receiver, [trace_id])
    otlp_receiver.wait_for(lambda spans: any(s.trace_id == cancel_trace and s.service == "scheduler" for s in spans))
    cancel_spans = [s for s in otlp_receiver.snapshot() if s.trace_id == cancel_trace]
    (gateway_request,) = [s for s in spans if s.service == "gateway" and s.kind == SERVER]
    (scheduler_request,) = [s for s in spans if s.service == "scheduler" and s.kind == SERVER]
    (cancel,) = [s for s in cancel_spans if s.service == "gateway" and s.kind == SERVER]
    (abort,) = [s for s in cancel_spans if s.service == "scheduler" and s.kind == SERVER]
    assert cancel.name.endswith("/CancelRequest") and abort.name.endswith("/Abort")
    assert (trace_id, gateway_request.span_id) in cancel.links
    assert (trace_id, scheduler_request.span_id) in abort.links
