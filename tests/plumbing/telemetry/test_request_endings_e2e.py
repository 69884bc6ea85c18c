"""How a request ended is visible the same way in spans, metrics and logs: a client that goes away
mid-stream (the common cancel), a stop string, a CancelRequest, a deadline that passes
mid-generation, a request refused at the door; and the GenAI semantic conventions on request spans.
Real processes, a real OTLP receiver, real scrapes. (Endings that take a process down:
test_request_endings_faults_e2e.)"""
from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest

from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.plumbing.telemetry.conftest import LONG_TOKENS, greedy_request, traceparent
from tests.plumbing.telemetry.test_metrics_e2e import MODEL, scrape, value

pytestmark = pytest.mark.slow

SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
STATUS_ERROR = 2


def log_entries(supervisor, process: str, request_id: str, needle: str, timeout_s: float = 10) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [entry for entry in (json.loads(line) for line in supervisor.tail(process) if line.startswith("{"))
                 if entry.get("request_id") == request_id and needle in entry["message"]]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)  # the child's output reaches the supervisor's reader thread a moment later


def ended_lines(supervisor, request_id: str) -> list[dict]:
    """The gateway's lines saying how the request ended (one per request, however it ended)."""
    return log_entries(supervisor, "gateway", request_id, f"request {request_id} ended: ")


def request_spans(otlp_receiver, trace_id: str) -> list:
    """The trace's spans once both the gateway's and the scheduler's request spans say how it ended."""
    def ended(spans):
        return {s.service for s in spans if s.trace_id == trace_id and s.kind == SERVER
                and "gen_ai.response.finish_reasons" in s.attributes} >= {"gateway", "scheduler"}

    return [s for s in otlp_receiver.wait_for(ended, timeout_s=60) if s.trace_id == trace_id]


def test_client_disconnect_is_recorded_in_spans_metrics_and_log(traced_cluster, otlp_receiver):
    config, supervisor = traced_cluster
    before = scrape("127.0.0.1", config.gateway_metrics_port)
    trace_id, parent = traceparent()
    prompt = "a client that leaves"
    with grpc.insecure_channel(config.gateway_address) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).GenerateStream(greedy_request("gone-1", prompt, 400),
            timeout=120, metadata=[("traceparent", parent)])
        received = sum(len(next(call).token_ids) for _ in range(3))
        call.cancel()

    def ended(spans):
        in_trace = [s for s in spans if s.trace_id == trace_id]
        return any(s.service == "gateway" and s.kind == SERVER and "gen_ai.response.finish_reasons" in s.attributes
                   for s in in_trace) and any(s.name == "scheduler.decode" for s in in_trace)

    spans = [s for s in otlp_receiver.wait_for(ended, timeout_s=60) if s.trace_id == trace_id]
    (request_span,) = [s for s in spans if s.service == "gateway" and s.kind == SERVER]
    assert request_span.attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert request_span.attributes["tokenmill.finish_cause"] == "client_disconnect"
    assert request_span.attributes["gen_ai.usage.output_tokens"] >= received
    (submit_span,) = [s for s in spans if s.service == "scheduler" and s.kind == SERVER]
    assert submit_span.attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert submit_span.attributes["tokenmill.finish_cause"] == "client_disconnect"
    assert submit_span.attributes["tokenmill.request_id"] == "gone-1"
    assert {"scheduler.queue", "scheduler.prefill", "scheduler.decode"} <= {s.name for s in spans}
    by_id = {s.span_id: s for s in spans}
    for span in spans:  # nothing starts after its parent ended (the abort sent on the way out included)
        parent_span = by_id.get(span.parent_span_id)
        if parent_span is not None:
            assert parent_span.start_ns <= span.start_ns <= parent_span.end_ns, (span.name, parent_span.name)

    after = scrape("127.0.0.1", config.gateway_metrics_port)

    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("tokenmill:request_success_total", finished_reason="abort") == 1
    assert moved("vllm:request_success_total", finished_reason="abort") == 1
    assert moved("tokenmill:e2e_request_latency_seconds_count") == 1
    assert moved("tokenmill:prompt_tokens_total") == len(prompt)
    assert moved("tokenmill:generation_tokens_total") >= received

    (line,) = log_entries(supervisor, "gateway", "gone-1", "ended: abort")
    assert line["trace_id"] == trace_id and "client went away" in line["message"]


def test_stop_string_is_recorded_as_stop_in_spans_metrics_and_log(traced_cluster, otlp_receiver):
    """A stop string the gateway matches ends the request as stop in the gateway and the scheduler alike
    (the gateway aborts it there with reason stop, then closes the call)."""
    config, supervisor = traced_cluster
    params = dict(temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        prompt = "stop where told"
        greedy = stub.Generate(generation_pb2.GenerateRequest(
            prompt=prompt, parameters=generation_pb2.GenerateParameters(max_tokens=40, **params)), timeout=60).text
        # the same greedy output comes again and holds this (a replacement character may never match:
        # an incomplete UTF-8 sequence is held back until it completes)
        stop = next(greedy[i:i + 2] for i in range(4, len(greedy) - 1) if "\ufffd" not in greedy[i:i + 2])
        before = scrape("127.0.0.1", config.gateway_metrics_port)
        trace_id, parent = traceparent()
        reply = stub.Generate(generation_pb2.GenerateRequest(
            request_id="stopped-1", prompt=prompt,
            parameters=generation_pb2.GenerateParameters(max_tokens=40, stop=[stop], **params)),
            timeout=60, metadata=[("traceparent", parent)])
    assert reply.finish_reason == common_pb2.FINISH_REASON_STOP and reply.matched_stop == stop

    spans = request_spans(otlp_receiver, trace_id)
    for service in ("gateway", "scheduler"):  # (the scheduler's Abort call is in the trace too)
        (span,) = [s for s in spans if s.service == service and s.kind == SERVER and not s.name.endswith("/Abort")]
        assert span.status_code != STATUS_ERROR, service
        assert span.attributes["gen_ai.response.finish_reasons"] == ["stop"], service
        assert "tokenmill.finish_cause" not in span.attributes, service

    after = scrape("127.0.0.1", config.gateway_metrics_port)
    for name in ("tokenmill:request_success_total", "vllm:request_success_total"):
        assert value(after, name, finished_reason="stop") - value(before, name, finished_reason="stop") == 1
    (line,) = ended_lines(supervisor, "stopped-1")
    assert line["trace_id"] == trace_id and "ended: stop," in line["message"]


def test_cancel_request_is_recorded_as_an_abort_in_spans_metrics_and_log(traced_cluster, otlp_receiver):
    config, supervisor = traced_cluster
    before = scrape("127.0.0.1", config.gateway_metrics_port)
    trace_id, parent = traceparent()
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.GenerateStream(greedy_request("cancelled-1", "cancel me by id", 400),
            timeout=120, metadata=[("traceparent", parent)])
        received = sum(len(next(call).token_ids) for _ in range(3))
        reply = stub.CancelRequest(generation_pb2.CancelRequestRequest(request_id="cancelled-1"), timeout=30)
        assert reply.cancelled
        for message in call:  # the stream ends with the abort, as a finish reason (not a status)
            received += len(message.token_ids)
        assert message.finish_reason == common_pb2.FINISH_REASON_ABORT and received < 400

    spans = request_spans(otlp_receiver, trace_id)
    for service in ("gateway", "scheduler"):
        (span,) = [s for s in spans if s.service == service and s.kind == SERVER]
        assert span.status_code != STATUS_ERROR, service
        assert span.attributes["gen_ai.response.finish_reasons"] == ["abort"], service
        assert "tokenmill.finish_cause" not in span.attributes, service  # not a disconnect: asked for
    assert {"scheduler.queue", "scheduler.prefill", "scheduler.decode"} <= {s.name for s in spans}

    after = scrape("127.0.0.1", config.gateway_metrics_port)
    for name in ("tokenmill:request_success_total", "vllm:request_success_total"):
        assert value(after, name, finished_reason="abort") - value(before, name, finished_reason="abort") == 1
    assert not [key for key in after if key[0] == "tokenmill:request_errors_total" and after[key] != before.get(key)]

    (line,) = ended_lines(supervisor, "cancelled-1")
    assert line["trace_id"] == trace_id and "ended: abort," in line["message"]


def test_deadline_mid_generation_is_recorded_in_spans_metrics_and_log(traced_cluster, otlp_receiver):
    """The client's deadline passes while tokens are streaming: the gateway's call is cut by gRPC (and the
    scheduler's with it), which must read as DEADLINE_EXCEEDED everywhere, not as a client gone away."""
    config, supervisor = traced_cluster
    ports = {"gateway": config.gateway_metrics_port, "scheduler": config.scheduler_metrics_port}
    before = {name: scrape("127.0.0.1", port) for name, port in ports.items()}
    trace_id, parent = traceparent()
    received = 0
    with grpc.insecure_channel(config.gateway_address) as channel, pytest.raises(grpc.RpcError) as expired:
        request = greedy_request("deadline-1", "too slow for its deadline", LONG_TOKENS)
        for message in generation_pb2_grpc.GenerationStub(channel).GenerateStream(request,
                timeout=1.5, metadata=[("traceparent", parent)]):
            received += len(message.token_ids)
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and 0 < received < LONG_TOKENS

    spans = request_spans(otlp_receiver, trace_id)
    for service in ("gateway", "scheduler"):
        (span,) = [s for s in spans if s.service == service and s.kind == SERVER]
        assert span.status_code == STATUS_ERROR, service
        assert span.status_message.startswith("DEADLINE_EXCEEDED: "), service
        assert span.attributes["error.type"] == "DEADLINE_EXCEEDED", service
        assert span.attributes["gen_ai.response.finish_reasons"] == ["error"], service
        assert span.attributes["tokenmill.finish_cause"] == "deadline", service
        assert span.events.count("exception") == 1, service
    (request_span,) = [s for s in spans if s.service == "gateway" and s.kind == SERVER]
    assert request_span.attributes["gen_ai.usage.output_tokens"] >= received
    assert {"scheduler.queue", "scheduler.prefill", "scheduler.decode"} <= {s.name for s in spans}

    after = {name: scrape("127.0.0.1", port) for name, port in ports.items()}
    for service in ports:
        assert value(after[service], "tokenmill:request_errors_total", code="DEADLINE_EXCEEDED") - value(
            before[service], "tokenmill:request_errors_total", code="DEADLINE_EXCEEDED") == 1, service
    gateway_before, gateway_after = before["gateway"], after["gateway"]
    assert value(gateway_after, "tokenmill:e2e_request_latency_seconds_count") - value(
        gateway_before, "tokenmill:e2e_request_latency_seconds_count") == 1
    assert value(gateway_after, "tokenmill:request_success_total", finished_reason="abort") == value(
        gateway_before, "tokenmill:request_success_total", finished_reason="abort")  # not counted as a cancel

    (line,) = ended_lines(supervisor, "deadline-1")
    assert line["trace_id"] == trace_id and line["level"] == "WARNING"
    assert "ended: error (DEADLINE_EXCEEDED: " in line["message"]


def test_refused_request_carries_its_id_operation_and_one_error_event(traced_cluster, otlp_receiver):
    config, supervisor = traced_cluster
    trace_id, parent = traceparent()
    chat = generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content="hi")])
    with grpc.insecure_channel(config.gateway_address) as channel, pytest.raises(grpc.RpcError) as refused:
        generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(
            request_id="refused-1", messages=chat, parameters=generation_pb2.GenerateParameters(max_tokens=10**6)),
            timeout=30, metadata=[("traceparent", parent)])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    spans = otlp_receiver.wait_for(lambda spans: any(
        s.trace_id == trace_id and s.kind == SERVER and s.status_code == STATUS_ERROR for s in spans))
    (span,) = [s for s in spans if s.trace_id == trace_id and s.kind == SERVER]
    assert span.attributes["tokenmill.request_id"] == "refused-1"
    assert span.attributes["gen_ai.operation.name"] == "chat"
    assert span.attributes["gen_ai.provider.name"] == "tokenmill"
    assert span.attributes["gen_ai.request.model"] == MODEL
    assert span.attributes["error.type"] == "INVALID_ARGUMENT"
    assert span.status_message.startswith("INVALID_ARGUMENT: ") and "max_tokens" in span.status_message
    assert span.events.count("exception") == 1
    (event,) = [attrs for name, attrs in zip(span.events, span.event_attributes) if name == "exception"]
    assert event["exception.type"] == "InvalidArgument" and "max_tokens" in event["exception.message"]
    assert not [v for s in spans if s.trace_id == trace_id for v in s.attributes.values()
                if isinstance(v, str) and "/work/" in v]  # no host paths
    (line,) = log_entries(supervisor, "gateway", "refused-1", "refused")
    assert line["trace_id"] == trace_id
    # the edge's own line (the status it answered) names the request too
    (status_line,) = log_entries(supervisor, "gateway", "refused-1", "-> INVALID_ARGUMENT")
    assert status_line["trace_id"] == trace_id


def test_request_spans_follow_the_genai_conventions(traced_cluster, otlp_receiver):
    """A text request over gRPC is a text_completion; a chat over HTTP is a chat; both name the
    provider, the request and response model, and the server they reached."""
    config, _ = traced_cluster
    grpc_trace, grpc_parent = traceparent()
    with grpc.insecure_channel(config.gateway_address) as channel:
        generation_pb2_grpc.GenerationStub(channel).Generate(generation_pb2.GenerateRequest(
            prompt="conventions", parameters=generation_pb2.GenerateParameters(max_tokens=2, ignore_eos=True)),
            timeout=60, metadata=[("traceparent", grpc_parent)])
    http_trace, http_parent = traceparent()
    # ignore_eos on both: a random-weight model may sample its end token within two tokens, which ends
    # the request as "stop" (CI saw it once); this test is about the span's names, not the ending.
    body = json.dumps({"model": MODEL, "max_tokens": 2, "ignore_eos": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(f"http://{config.http_address}/v1/chat/completions", data=body, headers={
        "Content-Type": "application/json", "traceparent": http_parent})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200

    def request_span(spans, trace_id):
        return [s for s in spans if s.trace_id == trace_id and s.kind == SERVER and s.service == "gateway"
                and "gen_ai.response.model" in s.attributes]

    spans = otlp_receiver.wait_for(lambda spans: request_span(spans, grpc_trace) and request_span(spans, http_trace))
    for trace_id, operation, port in ((grpc_trace, "text_completion", config.gateway_port),
                                      (http_trace, "chat", config.http_port)):
        (span,) = request_span(spans, trace_id)
        attributes = span.attributes
        assert attributes["gen_ai.operation.name"] == operation
        assert attributes["gen_ai.provider.name"] == "tokenmill"
        assert "gen_ai.system" not in attributes  # the deprecated name
        assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"] == MODEL
        assert attributes["server.address"] == "127.0.0.1" and attributes["server.port"] == port
        assert attributes["gen_ai.response.finish_reasons"] == ["length"]
        assert attributes["gen_ai.usage.output_tokens"] == 2
