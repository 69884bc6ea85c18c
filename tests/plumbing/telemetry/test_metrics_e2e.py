"""The Prometheus endpoints of real gateway, scheduler and worker processes: every metric is there,
and the ones each process owns move when requests run (errors included)."""
from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from plumbing.telemetry.metrics import SCHEDULER_METRICS

pytestmark = pytest.mark.slow


def scrape(host: str, port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from http://host:port/metrics."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def generate(stub, request_id: str, max_tokens: int) -> None:
    # the same long prompt each time: the second request finds its full blocks in the prefix cache
    request = generation_pb2.GenerateRequest(
        request_id=request_id, prompt="metrics " * 8,
        parameters=generation_pb2.GenerateParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    list(stub.GenerateStream(request, timeout=120))


def test_metrics_move_after_requests(traced_cluster):
    config, _ = traced_cluster
    host = "127.0.0.1"
    ports = {"gateway": config.gateway_metrics_port, "scheduler": config.scheduler_metrics_port,
             "worker": config.worker_metrics_port}
    before = {name: scrape(host, port) for name, port in ports.items()}
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        generate(stub, "metrics-1", 5)
        generate(stub, "metrics-2", 7)
        with pytest.raises(grpc.RpcError) as failed:  # more tokens than the gateway allows
            stub.Generate(generation_pb2.GenerateRequest(
                prompt="x", parameters=generation_pb2.GenerateParameters(max_tokens=10**6)), timeout=30)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = {name: scrape(host, port) for name, port in ports.items()}

    def moved(process: str, name: str, **labels) -> float:
        return value(after[process], name, **labels) - value(before[process], name, **labels)

    gateway = "gateway"
    assert moved(gateway, "tokenmill:time_to_first_token_seconds_count") == 2
    assert moved(gateway, "tokenmill:inter_token_latency_seconds_count") == 4 + 6
    assert moved(gateway, "tokenmill:e2e_request_latency_seconds_count") == 2
    assert moved(gateway, "tokenmill:e2e_request_latency_seconds_sum") > 0
    assert moved(gateway, "tokenmill:generation_tokens_total") == 12
    assert moved(gateway, "tokenmill:prompt_tokens_total") == 2 * len("metrics " * 8)
    assert moved(gateway, "tokenmill:request_success_total", finished_reason="length") == 2
    assert moved(gateway, "tokenmill:request_errors_total", code="INVALID_ARGUMENT") == 1

    assert moved("scheduler", "tokenmill:request_queue_time_seconds_count") == 2
    assert moved("scheduler", "tokenmill:prefix_cache_queries_total") == 2 * len("metrics " * 8)
    assert moved("scheduler", "tokenmill:prefix_cache_hits_total") >= 16  # the second request's first block
    for name in SCHEDULER_METRICS:  # all there, idle now
        assert (name, ()) in after["scheduler"], name
    assert value(after["scheduler"], "tokenmill:num_requests_running") == 0
    assert value(after["scheduler"], "tokenmill:kv_cache_usage_perc") < 1.0

    steps = sum(moved("worker", "tokenmill:worker_step_seconds_count", kind=kind)
                for kind in ("prefill", "decode", "mixed"))
    assert steps >= 5 + 7  # each request: one prefill step, then a decode step per further token
    assert moved("worker", "tokenmill:worker_step_seconds_count", kind="prefill") >= 1
    assert moved("worker", "tokenmill:worker_step_seconds_count", kind="decode") >= 4


def test_running_and_waiting_gauges_follow_the_load(traced_cluster):
    """While a long request runs, the scheduler's gauges show it (read live at scrape time)."""
    config, _ = traced_cluster
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.GenerateStream(generation_pb2.GenerateRequest(
            request_id="long-one", prompt="gauges",
            # long enough (the tiny model's context is 512) to be still running when scraped
            parameters=generation_pb2.GenerateParameters(max_tokens=500, temperature=0.0, ignore_eos=True)),
            timeout=120)
        next(call)  # running now
        seen = scrape("127.0.0.1", config.scheduler_metrics_port)
        call.cancel()
    assert value(seen, "tokenmill:num_requests_running") == 1
    assert value(seen, "tokenmill:kv_cache_usage_perc") > 0
    deadline = time.monotonic() + 60
    while value(scrape("127.0.0.1", config.scheduler_metrics_port), "tokenmill:num_requests_running") and \
            time.monotonic() < deadline:
        time.sleep(0.1)  # the cancel reaches the scheduler within a step or two
    assert value(scrape("127.0.0.1", config.scheduler_metrics_port), "tokenmill:num_requests_running") == 0
