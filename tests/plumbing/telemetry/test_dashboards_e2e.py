"""Every panel query of the shipped Grafana dashboards (ours and the vLLM-compatible one) finds data
in real scrapes of the three processes after some traffic, evaluated the way Prometheus would
(tests/helpers/promql.py), with the labels prometheus.yml gives each target."""
from __future__ import annotations

import json
import math
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from tests.plumbing.telemetry.conftest import greedy_request
from tests.helpers.promql import Query
from tests.plumbing.telemetry.test_metrics_e2e import MODEL

pytestmark = pytest.mark.slow
OBSERVABILITY = Path(__file__).resolve().parents[3] / "deploy" / "observability"
DASHBOARDS = ("tokenmill.json", "vllm.json")


def target_labels() -> dict[str, dict[str, str]]:
    """{"gateway": {"component": "gateway", "job": ...}, ...} from prometheus.yml's scrape configs."""
    config = yaml.safe_load((OBSERVABILITY / "prometheus.yml").read_text())
    labels = {}
    for job in config["scrape_configs"]:
        for group in job["static_configs"]:
            for target in group["targets"]:
                labels[target.split(":")[0]] = {"job": job["job_name"], **group.get("labels", {})}
    return labels


def scrape_all(config) -> dict:
    labels = target_labels()
    samples = {}
    for process, port in (("gateway", config.gateway_metrics_port), ("scheduler", config.scheduler_metrics_port),
                          ("worker", config.worker_metrics_port)):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = frozenset({**sample.labels, **labels[process]}.items())
                samples[(sample.name, key)] = sample.value
    return samples


def traffic(config) -> None:
    """Finished, cached-prefix, chat, refused and cancelled requests."""
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for _ in range(3):
            list(stub.GenerateStream(greedy_request("", "dashboards " * 6, 6),
                timeout=120))
        with pytest.raises(grpc.RpcError):
            stub.Generate(generation_pb2.GenerateRequest(
                prompt="x", parameters=generation_pb2.GenerateParameters(max_tokens=10**6)), timeout=30)
        call = stub.GenerateStream(generation_pb2.GenerateRequest(
            prompt="leaving", parameters=generation_pb2.GenerateParameters(max_tokens=400, ignore_eos=True)),
            timeout=120)
        next(call)
        call.cancel()
    body = json.dumps({"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = urllib.request.Request(f"http://{config.http_address}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200


def panel_queries() -> list[tuple[str, str, str]]:
    queries = []
    for file in DASHBOARDS:
        dashboard = json.loads((OBSERVABILITY / "grafana" / "dashboards" / file).read_text())
        assert dashboard["templating"]["list"][0]["name"] == "model_name"  # the variable vLLM's filters on
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                queries.append((file, panel["title"], target["expr"]))
    return queries


def has_data(result) -> bool:
    values = result.values() if isinstance(result, dict) else [result]
    return any(math.isfinite(value) for value in values)


def test_every_panel_of_the_shipped_dashboards_finds_data(traced_cluster):
    config, _ = traced_cluster
    before = scrape_all(config)
    started = time.monotonic()
    traffic(config)
    time.sleep(0.5)  # the cancel reaches the scheduler; its figures settle
    after = scrape_all(config)
    query = Query(before, after, elapsed_s=time.monotonic() - started)
    queries = panel_queries()
    assert len(queries) >= 40
    empty = []
    for file, title, expr in queries:
        result = query.evaluate(expr.replace("$model_name", MODEL).replace("$__rate_interval", "5m"))
        if not has_data(result):
            empty.append(f"{file} / {title}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
