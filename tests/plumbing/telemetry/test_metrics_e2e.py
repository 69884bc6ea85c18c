"""The Prometheus endpoints of real gateway, scheduler and worker processes: each serves the metrics
it owns (and no other), with a model_name label, under our names and vLLM's, and they move when
requests run (errors included)."""
from __future__ import annotations

import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from plumbing.telemetry.metrics import SCHEDULER_METRICS
from tests.plumbing.telemetry.conftest import LONG_TOKENS, greedy_request

pytestmark = pytest.mark.slow
MODEL = "tiny-llama"  # the tiny model's name: every request metric carries it as model_name


def scrape(host: str, port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from http://host:port/metrics."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples, name: str, **labels) -> float:
    labels.setdefault("model_name", MODEL)
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def families(samples) -> set[str]:
    return {name for name, _ in samples}


def generate(stub, request_id: str, max_tokens: int) -> None:
    # the same long prompt each time: the second request finds its full blocks in the prefix cache
    request = greedy_request(request_id, "metrics " * 8, max_tokens)
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

    assert_gateway_moved(before["gateway"], after["gateway"])
    assert_scheduler_moved(before["scheduler"], after["scheduler"])
    assert_worker_moved(before["worker"], after["worker"])


def _mover(before: dict, after: dict):
    def moved(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)
    return moved


def assert_gateway_moved(before: dict, after: dict) -> None:
    """Two requests of 5 and 7 tokens and one refusal, in the gateway's families and vLLM's."""
    moved = _mover(before, after)
    assert moved("tokenmill:time_to_first_token_seconds_count") == 2
    assert moved("tokenmill:inter_token_latency_seconds_count") == 4 + 6
    assert moved("tokenmill:e2e_request_latency_seconds_count") == 2
    assert moved("tokenmill:e2e_request_latency_seconds_sum") > 0
    assert moved("tokenmill:generation_tokens_total") == 12
    assert moved("tokenmill:prompt_tokens_total") == 2 * len("metrics " * 8)
    assert moved("tokenmill:request_success_total", finished_reason="length") == 2
    assert moved("tokenmill:request_errors_total", code="INVALID_ARGUMENT") == 1
    # vLLM's families beside ours, same values (what a stock vLLM dashboard reads)
    assert moved("vllm:request_success_total", finished_reason="length") == 2
    assert moved("vllm:e2e_request_latency_seconds_count") == 2
    assert moved("vllm:time_per_output_token_seconds_count") == 4 + 6
    assert moved("vllm:request_generation_tokens_count") == 2
    assert moved("vllm:request_generation_tokens_sum") == 12
    assert moved("vllm:request_prompt_tokens_bucket", le="100.0") == 2  # 64-token prompts
    assert moved("vllm:request_prompt_tokens_bucket", le="50.0") == 0
    assert moved("vllm:request_time_per_output_token_seconds_count") == 2
    # the request parameters vLLM exports (issue 38 item 5): once per client request that ran
    assert moved("vllm:request_params_n_count") == 2 and moved("vllm:request_params_n_sum") == 2
    assert moved("vllm:request_params_max_tokens_count") == 2
    assert moved("vllm:request_params_max_tokens_sum") == 5 + 7
    assert moved("tokenmill:request_params_max_tokens_bucket", le="10.0") == 2



def assert_scheduler_moved(before: dict, after: dict) -> None:
    moved = _mover(before, after)
    assert moved("tokenmill:request_queue_time_seconds_count") == 2
    assert moved("tokenmill:prefix_cache_queries_total") == 2 * len("metrics " * 8)
    assert moved("tokenmill:prefix_cache_hits_total") >= 16  # the second request's first block
    for name in SCHEDULER_METRICS:  # all there, idle now
        assert any(sample == name for sample in families(after)), name
    for phase in ("queue", "prefill", "decode", "inference"):
        assert moved(f"tokenmill:request_{phase}_time_seconds_count") == 2, phase
        assert moved(f"vllm:request_{phase}_time_seconds_count") == 2, phase
    # queue and prefill buckets fine enough for sub-100 ms: two requests on an idle scheduler queue for
    # well under 100 ms, which vLLM's request buckets (from 0.3 s) cannot tell apart
    assert moved("tokenmill:request_queue_time_seconds_bucket", le="0.1") == 2
    for phase in ("queue", "prefill"):
        for le in ("0.001", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1"):
            assert (f"vllm:request_{phase}_time_seconds_bucket", (("le", le), ("model_name", MODEL))) in \
                after, (phase, le)
    # Redis writes dropped carry model_name like every other request metric (none dropped: Redis is up)
    for kind in ("record", "token_stream"):
        key = ("tokenmill:redis_writes_dropped_total", (("kind", kind), ("model_name", MODEL)))
        assert after.get(key) == 0, kind
    info = [labels for name, labels in after if name == "vllm:cache_config_info"]
    assert len(info) == 1 and ("block_size", "16") in info[0] and ("model_name", MODEL) in info[0]
    assert value(after, "tokenmill:num_requests_running") == 0
    assert value(after, "tokenmill:kv_cache_usage_perc") < 1.0
    # the swap tier's families a stock vLLM dashboard reads: present, 0 without --swap-space-gb
    for name in ("vllm:num_requests_swapped", "vllm:cpu_cache_usage_perc"):
        assert name in families(after) and value(after, name) == 0, name



def assert_worker_moved(before: dict, after: dict) -> None:
    moved = _mover(before, after)
    steps = sum(moved("tokenmill:worker_step_seconds_count", kind=kind)
                for kind in ("prefill", "decode", "mixed"))
    assert steps >= 5 + 7  # each request: one prefill step, then a decode step per further token
    assert moved("tokenmill:worker_step_seconds_count", kind="prefill") >= 1
    assert moved("tokenmill:worker_step_seconds_count", kind="decode") >= 4
    assert moved("vllm:iteration_tokens_total_count") == steps
    # the first prompt in full, the second's uncached tail, one token per decode step
    assert moved("vllm:iteration_tokens_total_sum") >= len("metrics " * 8) + 4 + 6



def test_each_process_serves_only_what_it_owns(traced_cluster):
    """No histogram that never moves: the scheduler serves no client latency, the worker no request
    metric, the gateway no scheduler or worker figure."""
    config, _ = traced_cluster
    host = "127.0.0.1"
    gateway = families(scrape(host, config.gateway_metrics_port))
    scheduler = families(scrape(host, config.scheduler_metrics_port))
    worker = families(scrape(host, config.worker_metrics_port))
    client_side = {"tokenmill:time_to_first_token_seconds_count", "tokenmill:e2e_request_latency_seconds_count",
                   "tokenmill:request_success_total", "vllm:time_to_first_token_seconds_count"}
    scheduler_side = {"tokenmill:request_queue_time_seconds_count", "tokenmill:num_requests_waiting",
                      "vllm:num_requests_waiting"}
    worker_side = {"tokenmill:worker_step_seconds_count", "vllm:iteration_tokens_total_count"}
    assert client_side <= gateway and not client_side & (scheduler | worker)
    assert scheduler_side <= scheduler and not scheduler_side & (gateway | worker)
    assert worker_side <= worker and not worker_side & (gateway | scheduler)


def test_running_and_waiting_gauges_follow_the_load(traced_cluster):
    """While a long request runs, the scheduler's gauges show it (read live at scrape time)."""
    config, _ = traced_cluster
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.GenerateStream(greedy_request("long-one", "gauges", LONG_TOKENS),
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


def test_every_endpoint_serves_process_metrics(traced_cluster):
    """CPU, memory, open fds and GC of each process: prometheus_client's default collectors, which our own
    registry left out until issue 38."""
    config, _ = traced_cluster
    for port in (config.gateway_metrics_port, config.scheduler_metrics_port, config.worker_metrics_port):
        first = scrape("127.0.0.1", port)
        sum(range(3_000_000))  # nothing of ours: the processes' own CPU time moves as they serve scrapes
        second = scrape("127.0.0.1", port)
        assert second[("process_resident_memory_bytes", ())] > 10 * 2**20, port
        assert second[("process_open_fds", ())] >= 3, port
        assert second[("process_max_fds", ())] >= second[("process_open_fds", ())], port
        assert second[("process_cpu_seconds_total", ())] >= first[("process_cpu_seconds_total", ())] > 0, port
        assert second[("process_start_time_seconds", ())] < time.time(), port
        for generation in ("0", "1", "2"):
            assert second[("python_gc_collections_total", (("generation", generation),))] >= 0, port
            assert ("python_gc_objects_collected_total", (("generation", generation),)) in second, port
        assert any(name == "python_info" for name, _ in second), port


def kserve_infer(service_pb2, request_id: str, max_tokens: int, stream: bool = False, model: str = MODEL):
    infer = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    infer.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"triton says")
    if stream:
        infer.inputs.add(name="stream", datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
    for key, field, setting in (("max_tokens", "int64_param", max_tokens), ("temperature", "double_param", 0.0),
                                ("ignore_eos", "bool_param", True)):
        setattr(infer.parameters[key], field, setting)
    return infer


def scrape_text(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def test_kserve_requests_move_the_triton_metrics_by_exactly(traced_cluster):
    """Triton's nv_inference_* families (Triton's names: no _total; labels model and version) move by
    exactly what KServe requests did: successes (ModelInfer and ModelStreamInfer), a refusal, a cancel."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc  # tritonclient's stubs, as tests/gateway do

    config, _ = traced_cluster
    port, labels = config.gateway_metrics_port, {"model": MODEL, "version": "1"}

    def nv(samples, name: str, **extra) -> float:
        return samples.get((f"{name}_total", tuple(sorted({**labels, **extra}.items()))), 0.0)

    before = scrape("127.0.0.1", port)
    started = time.monotonic()
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for index, tokens in enumerate((3, 5)):
            stub.ModelInfer(kserve_infer(service_pb2, f"triton-{index}", tokens), timeout=60)
        replies = list(stub.ModelStreamInfer(iter([kserve_infer(service_pb2, "triton-2", 4, stream=True)]),
                                             timeout=60))
        assert replies and not any(reply.error_message for reply in replies)
        with pytest.raises(grpc.RpcError) as refused:  # more tokens than the gateway allows: refused, never run
            stub.ModelInfer(kserve_infer(service_pb2, "triton-3", 10**6), timeout=60)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        elapsed_us = (time.monotonic() - started) * 1e6
        cancelled = stub.ModelStreamInfer(iter([kserve_infer(service_pb2, "triton-4", LONG_TOKENS, stream=True)]),
                                          timeout=120)
        next(cancelled)  # streaming now
        cancelled.cancel()
    deadline = time.monotonic() + 30
    while nv(after := scrape("127.0.0.1", port), "nv_inference_request_failure", reason="CANCELED") == \
            nv(before, "nv_inference_request_failure", reason="CANCELED") and time.monotonic() < deadline:
        time.sleep(0.1)

    def moved(name: str, **extra) -> float:
        return nv(after, name, **extra) - nv(before, name, **extra)

    assert moved("nv_inference_request_success") == 3
    assert moved("nv_inference_count") == 3 and moved("nv_inference_exec_count") == 3
    assert moved("nv_inference_request_failure", reason="OTHER") == 1
    assert moved("nv_inference_request_failure", reason="CANCELED") == 1
    assert moved("nv_inference_request_failure", reason="BACKEND") == 0
    assert moved("nv_inference_request_failure", reason="REJECTED") == 0
    request_us, queue_us = moved("nv_inference_request_duration_us"), moved("nv_inference_queue_duration_us")
    compute_us = moved("nv_inference_compute_infer_duration_us")
    assert 0 < request_us <= elapsed_us and queue_us >= 0 and compute_us > 0
    assert request_us == queue_us + compute_us  # the successes' time, split into queue and compute
    text = scrape_text("127.0.0.1", port)  # Triton's spelling, so its dashboards' queries match
    assert "# TYPE nv_inference_request_success counter\n" in text
    assert '\nnv_inference_request_success{model="tiny-llama",version="1"} ' in text
    assert "nv_inference_request_success_total" not in text
