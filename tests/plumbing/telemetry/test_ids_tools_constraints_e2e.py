"""Issue 38 items 3 and 4, through a real OTLP receiver, real scrapes and the JSON logs: every API keeps the
client's id (KServe's ModelInferRequest.id, HTTP X-Request-Id) as the record id; a refused KServe request
carries the attributes and the `refused:` line every API's refusal does; a deadline gets the edge's
`-> DEADLINE_EXCEEDED` line; constraints and tools are visible (kind, hash, compile time, tools offered
and called, `tool_calls` as the finish reason in spans, metrics and logs)."""
from __future__ import annotations

import json
import urllib.request

import grpc
import pytest

from core.sampling import ConstraintKind, OutputConstraint
from gateway.telemetry import constraint_hash
from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from tests.plumbing.telemetry.conftest import LONG_TOKENS
from tests.plumbing.telemetry.test_metrics_e2e import MODEL, scrape, value
from tests.plumbing.telemetry.conftest import traceparent
from tests.plumbing.telemetry.test_request_endings_e2e import SERVER, STATUS_ERROR, ended_lines, log_entries

pytestmark = pytest.mark.slow


def kserve_request(service_pb2, request_id: str, max_tokens: int, model: str = MODEL):
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    text = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    text.contents.bytes_contents.append(b"a triton client asks")
    request.parameters["max_tokens"].int64_param = max_tokens
    request.parameters["temperature"].double_param = 0.0
    return request


def server_spans(otlp_receiver, trace_id: str, count: int = 1, ended: bool = True) -> list:
    """The gateway's SERVER spans of the trace, once `count` of them say how their request ended."""
    def done(spans):
        return len([s for s in spans if s.trace_id == trace_id and s.service == "gateway" and s.kind == SERVER
                    and (not ended or "gen_ai.response.finish_reasons" in s.attributes)]) >= count

    return [s for s in otlp_receiver.wait_for(done, timeout_s=60)
            if s.trace_id == trace_id and s.service == "gateway" and s.kind == SERVER]


def post(config, path: str, body: dict, headers: dict) -> tuple[dict, dict]:
    request = urllib.request.Request(f"http://{config.http_address}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read()), dict(response.headers)


def test_kserve_keeps_the_clients_id_and_runs_a_repeated_one_suffixed(traced_cluster, otlp_receiver):
    from tritonclient.grpc import service_pb2, service_pb2_grpc  # tritonclient's stubs, as tests/gateway do

    config, supervisor = traced_cluster
    trace_id, parent = traceparent()
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        replies = [stub.ModelInfer(kserve_request(service_pb2, "triton-kept", 4), timeout=60,
                                   metadata=[("traceparent", parent)]) for _ in range(2)]
        streamed = list(stub.ModelStreamInfer(iter([kserve_request(service_pb2, "triton-kept", 3)]), timeout=60,
                                              metadata=[("traceparent", parent)]))
    assert [reply.id for reply in replies] == ["triton-kept"] * 2  # the client's id, always
    assert streamed and all(r.infer_response.id == "triton-kept" and not r.error_message for r in streamed)

    ids = sorted(span.attributes["tokenmill.request_id"] for span in server_spans(otlp_receiver, trace_id, 3))
    assert ids[0] == "triton-kept"  # the first is the record id as sent
    assert [i.split("~")[0] for i in ids[1:]] == ["triton-kept"] * 2 and len(set(ids)) == 3  # repeats: suffixed
    for span in server_spans(otlp_receiver, trace_id, 3):
        assert span.attributes["gen_ai.response.id"] == span.attributes["tokenmill.request_id"]
    (line,) = ended_lines(supervisor, "triton-kept")
    assert line["trace_id"] == trace_id


def test_a_refused_kserve_request_carries_the_attributes_and_line_of_every_refusal(traced_cluster, otlp_receiver):
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    config, supervisor = traced_cluster
    trace_id, parent = traceparent()
    with grpc.insecure_channel(config.gateway_address) as channel, pytest.raises(grpc.RpcError) as refused:
        service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            kserve_request(service_pb2, "triton-refused", 10**6), timeout=60, metadata=[("traceparent", parent)])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    spans = otlp_receiver.wait_for(lambda spans: any(
        s.trace_id == trace_id and s.kind == SERVER and s.status_code == STATUS_ERROR for s in spans))
    (span,) = [s for s in spans if s.trace_id == trace_id and s.kind == SERVER]
    assert span.attributes["tokenmill.request_id"] == "triton-refused"
    assert span.attributes["tokenmill.refused"] is True
    assert span.attributes["gen_ai.response.finish_reasons"] == ["error"]
    assert span.attributes["gen_ai.operation.name"] == "text_completion"
    assert span.attributes["gen_ai.provider.name"] == "tokenmill" and span.attributes["gen_ai.request.model"] == MODEL
    (line,) = log_entries(supervisor, "gateway", "triton-refused", "request triton-refused refused: INVALID_ARGUMENT")
    assert line["trace_id"] == trace_id


def test_http_x_request_id_is_the_record_and_response_id(traced_cluster, otlp_receiver):
    config, supervisor = traced_cluster
    trace_id, parent = traceparent()
    body, headers = post(config, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3},
                         {"X-Request-Id": "http-kept", "traceparent": parent})
    assert body["id"] == "http-kept" and headers["X-Request-Id"] == "http-kept"
    (span,) = server_spans(otlp_receiver, trace_id)
    assert span.attributes["tokenmill.request_id"] == span.attributes["gen_ai.response.id"] == "http-kept"
    assert ended_lines(supervisor, "http-kept")


def test_a_deadline_gets_the_edge_line(traced_cluster):
    config, supervisor = traced_cluster
    with grpc.insecure_channel(config.gateway_address) as channel, pytest.raises(grpc.RpcError) as expired:
        for _ in generation_pb2_grpc.GenerationStub(channel).GenerateStream(generation_pb2.GenerateRequest(
                request_id="deadline-edge", prompt="too slow for its deadline",
                parameters=generation_pb2.GenerateParameters(max_tokens=LONG_TOKENS, temperature=0.0,
                                                             ignore_eos=True)), timeout=1.5):
            pass
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    (line,) = log_entries(supervisor, "gateway", "deadline-edge", "-> DEADLINE_EXCEEDED: ")
    assert "GenerateStream" in line["message"]


def test_constraints_are_visible_by_kind_hash_and_compile_time(traced_cluster, otlp_receiver):
    config, supervisor = traced_cluster
    port = config.gateway_metrics_port
    before = scrape("127.0.0.1", port)
    trace_id, parent = traceparent()
    for number in range(2):  # the same regex twice: one hash
        post(config, "/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 4, "guided_regex": "[ab]{3}"},
             {"X-Request-Id": f"regex-{number}", "traceparent": parent})
    spans = server_spans(otlp_receiver, trace_id, 2)
    want = constraint_hash(OutputConstraint(ConstraintKind.REGEX, "[ab]{3}"))
    for span in spans:
        assert span.attributes["tokenmill.constraint.kind"] == "regex"
        assert span.attributes["tokenmill.constraint.hash"] == want
        assert span.attributes["tokenmill.constraint.compile_ms"] >= 0
    after = scrape("127.0.0.1", port)
    assert value(after, "tokenmill:constrained_requests_total", kind="regex") - value(
        before, "tokenmill:constrained_requests_total", kind="regex") == 2
    assert value(after, "tokenmill:constraint_compile_seconds_count") - value(
        before, "tokenmill:constraint_compile_seconds_count") == 2


def test_a_tool_call_ends_as_tool_calls_in_span_metrics_and_log(traced_cluster, otlp_receiver):
    config, supervisor = traced_cluster
    port = config.gateway_metrics_port
    before = scrape("127.0.0.1", port)
    trace_id, parent = traceparent()
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
            "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": name, "parameters": city}} for name in ("weather", "time")]
    body, _ = post(config, "/v1/chat/completions",
                   {"model": MODEL, "messages": [{"role": "user", "content": "weather in Paris?"}], "tools": tools,
                    "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 400, "temperature": 0},
                   {"X-Request-Id": "tools-1", "traceparent": parent})
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls", choice
    called = [call["function"]["name"] for call in choice["message"]["tool_calls"]]

    (span,) = server_spans(otlp_receiver, trace_id)
    assert span.attributes["gen_ai.response.finish_reasons"] == ["tool_calls"]
    assert span.attributes["tokenmill.tools.names"] == ["weather", "time"]
    assert span.attributes["tokenmill.tools.count"] == 2 and span.attributes["tokenmill.tool_choice"] == "required"
    assert span.attributes["tokenmill.tool_calls.names"] == called
    assert span.attributes["tokenmill.tool_calls.outcome"] == "parsed"
    assert span.attributes["tokenmill.constraint.kind"] == "grammar"
    assert span.attributes["tokenmill.constraint.field"] == "tools"
    after = scrape("127.0.0.1", port)
    assert value(after, "tokenmill:request_success_total", finished_reason="tool_calls") - value(
        before, "tokenmill:request_success_total", finished_reason="tool_calls") == 1
    assert value(after, "tokenmill:request_success_total", finished_reason="stop") == value(
        before, "tokenmill:request_success_total", finished_reason="stop")
    assert value(after, "tokenmill:tool_calls_total", outcome="parsed") - value(
        before, "tokenmill:tool_calls_total", outcome="parsed") == len(called)
    (line,) = ended_lines(supervisor, "tools-1")
    assert "ended: tool_calls, " in line["message"]
