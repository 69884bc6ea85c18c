"""Endings that take a process away, visible the same way in spans, metrics and logs: the worker killed
(-9) mid-generation fails the request (the package's cluster does not retry), and a SIGTERM drain of
the scheduler or of the gateway (gRPC and HTTP) whose timeout (1 s there) passes before the request
finishes. Each test restarts what it stopped and waits for the cluster to serve again before it ends.
Real processes, a real OTLP receiver, real scrapes."""
from __future__ import annotations

import contextlib
import http.client
import json
import signal
import threading
import time

import grpc
import pytest

from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from tests.plumbing.telemetry.conftest import LONG_TOKENS
from tests.plumbing.telemetry.test_metrics_e2e import MODEL, scrape, value
from tests.plumbing.telemetry.test_request_endings_e2e import (SERVER, STATUS_ERROR, ended_lines, log_entries,
                                                               request_spans, traceparent)

pytestmark = pytest.mark.slow


def long_request(request_id: str) -> generation_pb2.GenerateRequest:
    # seconds of decoding, so the fault lands mid-generation
    return generation_pb2.GenerateRequest(request_id=request_id, prompt="a request a fault ends",
                                          parameters=generation_pb2.GenerateParameters(
                                              max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True))


def errors(samples, code: str) -> float:
    return value(samples, "tokenmill:request_errors_total", code=code)


def assert_counted_one_unavailable(before, after) -> None:
    """Between two scrapes of one service: one more UNAVAILABLE error, one more request timed end to end."""
    assert errors(after, "UNAVAILABLE") - errors(before, "UNAVAILABLE") == 1
    assert value(after, "tokenmill:e2e_request_latency_seconds_count") - value(
        before, "tokenmill:e2e_request_latency_seconds_count") == 1


def scrape_drained_gateway(config, before) -> dict:
    """Scrapes the stopping gateway a second after its drain cut the request, until the cut request's
    ending shows. Without --metrics-linger-s (3 s here) the process is gone by then (measured: within
    0.1 s of the cut), and with it every count of that ending."""
    time.sleep(1.0)
    deadline = time.monotonic() + 5
    while True:
        try:
            after = scrape("127.0.0.1", config.gateway_metrics_port)
        except OSError as error:
            raise AssertionError(f"the gateway's /metrics went away before its drained ending was scraped: {error}")
        if errors(after, "UNAVAILABLE") > errors(before, "UNAVAILABLE") or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def wait_serving(config, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        while True:
            try:
                stub.Generate(generation_pb2.GenerateRequest(
                    prompt="ping", parameters=generation_pb2.GenerateParameters(max_tokens=2)), timeout=10)
                return
            except grpc.RpcError:
                assert time.monotonic() < deadline, "the cluster not serving again"
                time.sleep(0.1)


class Sigterm:
    """SIGTERMs one service from a thread, once: Supervisor.kill waits for the exit, and the drain
    being timed needs the stream read meanwhile. On leaving the `with`: the stop finished, then restore()."""

    def __init__(self, config, supervisor, service: str, still_running: str) -> None:
        self.config, self.supervisor, self.service, self.still_running = config, supervisor, service, still_running
        self.thread = None

    def send(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self.supervisor.kill, args=(self.service, signal.SIGTERM))
            self.thread.start()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def assert_exited_cleanly(self) -> None:
        """Waits for the stop: the service exited 0 (it drained; it was not killed)."""
        self.join()
        assert self.supervisor.children[self.service].returncode == 0

    def __enter__(self) -> Sigterm:
        return self

    def __exit__(self, *exc_info) -> None:
        self.join()
        restore(self.config, self.supervisor, self.service, self.still_running)


def stream_until_cut(config, request_id: str, parent: str, stopping: Sigterm) -> tuple[int, grpc.RpcError]:
    """Streams a long request over gRPC, SIGTERMs stopping's service once 3 tokens have come, and returns
    the tokens received and the error that cut the stream."""
    received = 0
    with grpc.insecure_channel(config.gateway_address) as channel, pytest.raises(grpc.RpcError) as cut:
        for message in generation_pb2_grpc.GenerationStub(channel).GenerateStream(
                long_request(request_id), timeout=60, metadata=[("traceparent", parent)]):
            received += len(message.token_ids)
            if received >= 3:
                stopping.send()
    return received, cut.value


def restore(config, supervisor, service: str, still_running: str = "") -> None:
    """After a test: the service restarted if it is down, the cluster serving again, and the request
    named still_running (resumable, so still in the scheduler) cancelled."""
    if not supervisor.children[service].alive:
        supervisor.restart(service)
    wait_serving(config)
    if still_running:
        with grpc.insecure_channel(config.gateway_address) as channel:
            generation_pb2_grpc.GenerationStub(channel).CancelRequest(
                generation_pb2.CancelRequestRequest(request_id=still_running), timeout=30)


def assert_gateway_span_drained(otlp_receiver, trace_id: str):
    """The gateway's one server span of the trace: ended by its drain (UNAVAILABLE, cause drained)."""
    spans = otlp_receiver.wait_for(lambda spans: any(
        s.trace_id == trace_id and s.service == "gateway" and s.kind == SERVER for s in spans))
    (span,) = [s for s in spans if s.trace_id == trace_id and s.service == "gateway" and s.kind == SERVER]
    assert span.status_code == STATUS_ERROR and span.status_message.startswith("UNAVAILABLE: ")
    assert span.attributes["error.type"] == "UNAVAILABLE"
    assert span.attributes["gen_ai.response.finish_reasons"] == ["error"]
    assert span.attributes["tokenmill.finish_cause"] == "drained"
    assert span.events.count("exception") == 1
    return span


def assert_ended_line_drained(supervisor, request_id: str, trace_id: str) -> None:
    (line,) = ended_lines(supervisor, request_id)
    assert line["trace_id"] == trace_id and line["level"] == "WARNING"
    assert "ended: error (UNAVAILABLE: " in line["message"] and "drain timeout" in line["message"]


def assert_ended_with_error(spans, code: str, scheduler_cause: str) -> None:
    """Both request spans: status ERROR ("CODE: message", as a refusal's) with error.type, finish reason
    error, one exception event."""
    for service in ("gateway", "scheduler"):
        (span,) = [s for s in spans if s.service == service and s.kind == SERVER]
        assert span.status_code == STATUS_ERROR and span.status_message.startswith(f"{code}: "), service
        assert span.attributes["error.type"] == code, service
        assert span.attributes["gen_ai.response.finish_reasons"] == ["error"], service
        assert span.events.count("exception") == 1, service
        if service == "scheduler":
            assert span.attributes["tokenmill.finish_cause"] == scheduler_cause
    assert {"scheduler.queue", "scheduler.prefill", "scheduler.decode"} <= {s.name for s in spans}


def test_worker_killed_mid_generation_fails_the_request_in_spans_metrics_and_log(traced_cluster, otlp_receiver):
    config, supervisor = traced_cluster
    ports = {"gateway": config.gateway_metrics_port, "scheduler": config.scheduler_metrics_port}
    before = {name: scrape("127.0.0.1", port) for name, port in ports.items()}
    trace_id, parent = traceparent()
    received = 0
    try:
        with grpc.insecure_channel(config.gateway_address) as channel, pytest.raises(grpc.RpcError) as failed:
            for message in generation_pb2_grpc.GenerationStub(channel).GenerateStream(
                    long_request("failed-1"), timeout=60, metadata=[("traceparent", parent)]):
                received += len(message.token_ids)
                if received >= 3 and supervisor.children["worker"].alive:
                    supervisor.kill("worker")  # SIGKILL
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and "worker unavailable" in failed.value.details()
        assert 0 < received < LONG_TOKENS
        # one line naming the worker and its status, not str(AioRpcError)'s multi-line dump
        details = failed.value.details()
        assert f"ExecuteStep on worker {config.worker_address} failed: UNAVAILABLE: " in details, details
        assert "\n" not in details and "AioRpcError" not in details and "debug_error_string" not in details

        spans = request_spans(otlp_receiver, trace_id)
        assert_ended_with_error(spans, "UNAVAILABLE", scheduler_cause="worker_failed")
        after = {name: scrape("127.0.0.1", port) for name, port in ports.items()}
        assert errors(after["scheduler"], "UNAVAILABLE") - errors(before["scheduler"], "UNAVAILABLE") == 1
        assert_counted_one_unavailable(before["gateway"], after["gateway"])

        (line,) = ended_lines(supervisor, "failed-1")
        assert line["trace_id"] == trace_id and line["level"] == "WARNING"
        assert "ended: error (UNAVAILABLE: " in line["message"] and "worker unavailable" in line["message"]
        assert f"ExecuteStep on worker {config.worker_address} failed" in line["message"]
        assert "\n" not in line["message"] and "AioRpcError" not in line["message"]
        (status_line,) = log_entries(supervisor, "scheduler", "failed-1", "-> UNAVAILABLE")
        assert status_line["trace_id"] == trace_id
    finally:
        restore(config, supervisor, "worker")


def test_scheduler_drain_timeout_ends_the_request_in_spans_metrics_and_log(traced_cluster, otlp_receiver):
    """SIGTERM: the scheduler refuses new work and gives in-flight requests the drain timeout; one still
    running then ends UNAVAILABLE saying so (not cut by the server's stop, which read as its gateway
    gone). The request itself is resumable: the restarted scheduler re-admits it."""
    config, supervisor = traced_cluster
    before = scrape("127.0.0.1", config.gateway_metrics_port)
    trace_id, parent = traceparent()
    with Sigterm(config, supervisor, "scheduler", still_running="drained-1") as stopping:  # re-admitted
        received, drained = stream_until_cut(config, "drained-1", parent, stopping)
        stopping.assert_exited_cleanly()
        assert drained.code() == grpc.StatusCode.UNAVAILABLE
        assert "drain timeout of 1s passed" in drained.details() and 0 < received < LONG_TOKENS

        spans = request_spans(otlp_receiver, trace_id)  # the scheduler's, exported as it stopped
        assert_ended_with_error(spans, "UNAVAILABLE", scheduler_cause="drained")
        after = scrape("127.0.0.1", config.gateway_metrics_port)
        assert_counted_one_unavailable(before, after)

        (line,) = ended_lines(supervisor, "drained-1")
        assert line["trace_id"] == trace_id and "drain timeout" in line["message"]
        (status_line,) = log_entries(supervisor, "scheduler", "drained-1", "-> UNAVAILABLE")
        assert status_line["trace_id"] == trace_id and "drain timeout" in status_line["message"]


def test_gateway_drain_timeout_ends_the_call_in_spans_and_log(traced_cluster, otlp_receiver):
    """SIGTERM to the gateway: a stream still running when its drain timeout passes is cut by the server's
    stop, which must read as drained (UNAVAILABLE), not as its client gone away; its counter is scraped
    while the stopping gateway keeps /metrics up (--metrics-linger-s). The request itself runs on in the
    scheduler, for the client to resume by id on another gateway."""
    config, supervisor = traced_cluster
    before = scrape("127.0.0.1", config.gateway_metrics_port)
    trace_id, parent = traceparent()
    with Sigterm(config, supervisor, "gateway", still_running="gateway-drained-1") as stopping:
        received, drained = stream_until_cut(config, "gateway-drained-1", parent, stopping)
        after = scrape_drained_gateway(config, before)
        stopping.assert_exited_cleanly()
        assert drained.code() == grpc.StatusCode.UNAVAILABLE and 0 < received < LONG_TOKENS
        assert_counted_one_unavailable(before, after)

        assert_gateway_span_drained(otlp_receiver, trace_id)
        assert_ended_line_drained(supervisor, "gateway-drained-1", trace_id)


def test_gateway_drain_timeout_ends_an_http_stream_in_spans_and_log(traced_cluster, otlp_receiver):
    """The same drain on the OpenAI HTTP API: a stream=true completion still running when the drain
    timeout passes is cut by the HTTP server's stop, which must read as drained (UNAVAILABLE), not as
    its client gone away; its counter is scraped while the gateway lingers, as for gRPC."""
    config, supervisor = traced_cluster
    before = scrape("127.0.0.1", config.gateway_metrics_port)
    trace_id, parent = traceparent()
    body = json.dumps({"model": MODEL, "prompt": "a request a fault ends", "max_tokens": LONG_TOKENS, "temperature": 0,
                       "ignore_eos": True, "stream": True})
    host, port = config.http_address.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    with Sigterm(config, supervisor, "gateway", still_running="http-drained-1") as stopping, \
            contextlib.closing(connection):
        connection.request("POST", "/v1/completions", body=body, headers={
            "Content-Type": "application/json", "traceparent": parent, "X-Request-Id": "http-drained-1"})
        response = connection.getresponse()
        assert response.status == 200
        events = []
        with contextlib.suppress(http.client.IncompleteRead):  # the stream is cut (no final chunk)
            while line := response.readline():
                events += [line] if line.startswith(b"data: ") else []
                if len(events) >= 3:
                    stopping.send()
        after = scrape_drained_gateway(config, before)
        stopping.assert_exited_cleanly()
        assert b"data: [DONE]\n" not in events and len(events) < LONG_TOKENS
        # not cut without a word: the last event says how to go on (the request is resumable)
        last = json.loads(events[-1][len(b"data: "):])["error"]
        assert last["code"] == "service_unavailable" and "Last-Event-ID: http-drained-1:" in last["message"], last
        assert errors(after, "UNAVAILABLE") - errors(before, "UNAVAILABLE") == 1

        assert assert_gateway_span_drained(otlp_receiver, trace_id).name == "POST /v1/completions"
        assert_ended_line_drained(supervisor, "http-drained-1", trace_id)
