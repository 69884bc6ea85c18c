"""Issue 38's "Done when": 30 mixed requests, at once, on all three APIs (native gRPC, KServe through
tritonclient's stubs, OpenAI HTTP), traced to a real OTLP receiver and scraped before and after:

- no ERROR span anywhere (request traces and the background work they caused);
- no request span longer than its request as the client timed it, nor any span of its trace outside it;
- KServe's ModelInferRequest.id and HTTP's X-Request-Id kept as the record and response ids;
- constraint and tool attributes on the requests that had them;
- Triton's and the process metrics moved by exactly what the requests did."""
from __future__ import annotations

import json
import secrets
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import pytest

from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from tests.plumbing.telemetry.test_metrics_e2e import MODEL, scrape, value

pytestmark = pytest.mark.slow

SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind
STATUS_ERROR = 2
FLUSH_NS = 1_000_000_000  # a span of the request may end this long after the request span (export batch)
RUN = secrets.token_hex(3)  # ids unique to this run: a KServe id repeated in Redis would run suffixed


STREAM_SPAN_SLACK_NS = 20_000_000


@dataclass
class Sent:
    api: str
    request_id: str
    trace_id: str
    started_ns: int = 0
    ended_ns: int = 0
    reply: dict = field(default_factory=dict)


def traced(api: str, request_id: str) -> tuple[Sent, str]:
    trace_id = secrets.token_hex(16)
    return Sent(api, request_id, trace_id), f"00-{trace_id}-{secrets.token_hex(8)}-01"


def timed(sent: Sent, call) -> Sent:
    sent.started_ns = time.time_ns()
    sent.reply = call() or {}
    sent.ended_ns = time.time_ns()
    return sent


def native(config, index: int) -> Sent:
    sent, parent = traced("grpc", f"i38-grpc-{RUN}-{index}")
    request = generation_pb2.GenerateRequest(request_id=sent.request_id, prompt=f"native {index}",
                                             parameters=generation_pb2.GenerateParameters(max_tokens=4 + index % 3,
                                                                                          ignore_eos=True))

    def call():
        with grpc.insecure_channel(config.gateway_address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            if index % 2:
                stub.Generate(request, timeout=120, metadata=[("traceparent", parent)])
            else:
                list(stub.GenerateStream(request, timeout=120, metadata=[("traceparent", parent)]))

    return timed(sent, call)


def kserve(config, index: int) -> Sent:
    from tritonclient.grpc import service_pb2, service_pb2_grpc  # tritonclient's stubs, as tests/gateway do

    sent, parent = traced("kserve", f"i38-kserve-{RUN}-{index}")
    infer = service_pb2.ModelInferRequest(model_name=MODEL, id=sent.request_id)
    infer.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"triton asks")
    if index % 2:
        infer.inputs.add(name="stream", datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
    infer.parameters["max_tokens"].int64_param = 3 + index % 3
    infer.parameters["ignore_eos"].bool_param = True

    def call():
        with grpc.insecure_channel(config.gateway_address) as channel:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            if index % 2:
                replies = list(stub.ModelStreamInfer(iter([infer]), timeout=120, metadata=[("traceparent", parent)]))
                assert not any(reply.error_message for reply in replies)
                return {"ids": {reply.infer_response.id for reply in replies}}
            return {"ids": {stub.ModelInfer(infer, timeout=120, metadata=[("traceparent", parent)]).id}}

    return timed(sent, call)


def http(config, index: int) -> Sent:
    kind = ("tools", "regex", "plain", "plain", "stream")[index % 5]
    sent, parent = traced(f"http-{kind}", f"i38-http-{RUN}-{index}")
    path, body = "/v1/completions", {"model": MODEL, "prompt": f"http {index}", "max_tokens": 4}
    if kind == "tools":
        city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                "additionalProperties": False}
        path, body = "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "weather in Paris?"}], "max_tokens": 400,
            "tools": [{"type": "function", "function": {"name": name, "parameters": city}}
                      for name in ("weather", "time")],
            "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
    elif kind == "regex":
        body["guided_regex"] = "[ab]{3}"
    elif kind == "stream":
        body["stream"] = True
    request = urllib.request.Request(f"http://{config.http_address}{path}", data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "X-Request-Id": sent.request_id, "traceparent": parent})

    def call():
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read().decode()
            reply = {"header": response.headers["X-Request-Id"]}
            if kind != "stream":
                reply["body"] = json.loads(text)
            return reply

    return timed(sent, call)


def run_all(config) -> list[Sent]:
    calls = [(api, index) for index in range(10) for api in (native, kserve, http)]
    with ThreadPoolExecutor(max_workers=10) as pool:
        return list(pool.map(lambda job: job[0](config, job[1]), calls))


def request_spans(otlp_receiver, sent: list[Sent]) -> list:
    """Every span of the requests' traces once each has its gateway and scheduler request spans ended."""
    trace_ids = {s.trace_id for s in sent}

    def ended(spans):
        done = {(s.trace_id, s.service) for s in spans if s.kind == SERVER and "gen_ai.response.finish_reasons"
                in s.attributes}
        return all({(t, "gateway"), (t, "scheduler")} <= done for t in trace_ids)

    otlp_receiver.wait_for(ended, timeout_s=120)
    time.sleep(1.0)  # the rest of the last batch
    return [s for s in otlp_receiver.snapshot() if s.trace_id in trace_ids]


def scrape_all(config) -> dict:
    return {name: scrape("127.0.0.1", port) for name, port in (
        ("gateway", config.gateway_metrics_port), ("scheduler", config.scheduler_metrics_port),
        ("worker", config.worker_metrics_port))}


def test_thirty_mixed_requests_on_all_three_apis(traced_cluster, otlp_receiver):
    config, _ = traced_cluster
    before = scrape_all(config)
    started_ns = time.time_ns()
    sent = run_all(config)
    spans = request_spans(otlp_receiver, sent)
    after = scrape_all(config)

    errors = [s for s in otlp_receiver.snapshot() if s.start_ns >= started_ns and s.status_code == STATUS_ERROR]
    assert not errors, sorted({(s.service, s.name, s.status_message) for s in errors})
    by_trace = {request.trace_id: request for request in sent}
    gateway_request = {s.trace_id: s for s in spans if s.service == "gateway" and s.kind == SERVER}
    assert set(gateway_request) == set(by_trace)
    for trace_id, request in by_trace.items():
        span = gateway_request[trace_id]
        # a stream's span closes after its last chunk is written, which the client may read (and stop its clock
        # on) first: by 2.6 ms in one run with two test files beside it (pytest-xdist)
        slack_ns = STREAM_SPAN_SLACK_NS if request.api == "http-stream" else 0
        assert span.end_ns - span.start_ns <= request.ended_ns - request.started_ns + slack_ns, request
        late = [s.name for s in spans if s.trace_id == trace_id and
                (s.start_ns < span.start_ns or s.end_ns > span.end_ns + FLUSH_NS)]
        assert not late, (request, late)
    check_ids(sent, gateway_request)
    check_tools_and_constraints(sent, gateway_request)
    check_metrics(before, after, sent)


def check_ids(sent: list[Sent], gateway_request: dict) -> None:
    for request in sent:
        attributes = gateway_request[request.trace_id].attributes
        assert attributes["tokenmill.request_id"] == attributes["gen_ai.response.id"] == request.request_id, request
        if request.api == "kserve":
            assert request.reply["ids"] == {request.request_id}  # every response carries the client's id
        elif request.api.startswith("http"):
            assert request.reply["header"] == request.request_id
            assert request.reply.get("body", {"id": request.request_id})["id"] == request.request_id


def check_tools_and_constraints(sent: list[Sent], gateway_request: dict) -> None:
    for request in sent:
        attributes = gateway_request[request.trace_id].attributes
        if request.api == "http-regex":
            assert attributes["tokenmill.constraint.kind"] == "regex"
            assert attributes["tokenmill.constraint.hash"] and attributes["tokenmill.constraint.compile_ms"] >= 0
        elif request.api == "http-tools":
            (choice,) = request.reply["body"]["choices"]
            called = [call["function"]["name"] for call in choice["message"]["tool_calls"]]
            assert choice["finish_reason"] == "tool_calls"
            assert attributes["gen_ai.response.finish_reasons"] == ["tool_calls"]
            assert attributes["tokenmill.tools.names"] == ["weather", "time"]
            assert attributes["tokenmill.tools.count"] == 2
            assert attributes["tokenmill.tool_choice"] == "required"
            assert attributes["tokenmill.tool_calls.names"] == called
            assert attributes["tokenmill.tool_calls.outcome"] == "parsed"
        else:
            assert "tokenmill.constraint.kind" not in attributes and "tokenmill.tools.names" not in attributes


def check_metrics(before: dict, after: dict, sent: list[Sent]) -> None:
    def moved(process: str, name: str, **labels) -> float:
        return value(after[process], name, **labels) - value(before[process], name, **labels)

    def nv(name: str, **labels) -> float:  # Triton's labels, no model_name
        key = (f"{name}_total", tuple(sorted({"model": MODEL, "version": "1", **labels}.items())))
        return after["gateway"].get(key, 0.0) - before["gateway"].get(key, 0.0)

    def bare(samples: dict, name: str) -> float:  # a process metric: no labels
        return samples[(name, ())]

    kserve = sum(request.api == "kserve" for request in sent)
    assert nv("nv_inference_request_success") == kserve == 10
    assert nv("nv_inference_count") == nv("nv_inference_exec_count") == kserve
    for reason in ("CANCELED", "REJECTED", "BACKEND", "OTHER"):
        assert nv("nv_inference_request_failure", reason=reason) == 0, reason
    assert nv("nv_inference_request_duration_us") == nv("nv_inference_queue_duration_us") + nv(
        "nv_inference_compute_infer_duration_us") > 0
    kserve_wall_us = sum(r.ended_ns - r.started_ns for r in sent if r.api == "kserve") / 1e3
    assert nv("nv_inference_request_duration_us") <= kserve_wall_us
    assert moved("gateway", "tokenmill:e2e_request_latency_seconds_count") == 30
    assert moved("gateway", "vllm:request_params_n_count") == 30
    tools = sum(request.api == "http-tools" for request in sent)
    assert moved("gateway", "tokenmill:request_success_total", finished_reason="tool_calls") == tools
    assert sum(moved("gateway", "tokenmill:request_success_total", finished_reason=reason)
               for reason in ("stop", "length", "tool_calls", "abort")) == 30
    assert moved("gateway", "tokenmill:request_success_total", finished_reason="abort") == 0
    for process in ("gateway", "scheduler", "worker"):
        # none restarted; each worked
        assert bare(after[process], "process_start_time_seconds") == bare(before[process], "process_start_time_seconds")
        assert bare(after[process], "process_cpu_seconds_total") > bare(before[process], "process_cpu_seconds_total")
        assert bare(after[process], "process_resident_memory_bytes") > 0
        assert bare(after[process], "process_open_fds") > 0
    assert moved("scheduler", "tokenmill:request_queue_time_seconds_count") == 30
