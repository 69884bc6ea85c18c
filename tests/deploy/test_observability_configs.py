"""deploy/observability: the collector, Prometheus and Grafana files parse, are wired to each other,
and every PromQL expression on the dashboard reads metrics tokenmill actually exports."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from plumbing.telemetry.metrics import exported_metric_names

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "observability"
METRIC = re.compile(r"\b(?:tokenmill|vllm):[A-Za-z0-9_:]+")
DASHBOARDS = ("tokenmill.json", "vllm.json")  # ours, and the vLLM-compatible one over the vllm:* names


def load_yaml(relative: str) -> dict:
    return yaml.safe_load((ROOT / relative).read_text())


def dashboard_exprs() -> list[str]:
    return [target["expr"] for name in DASHBOARDS
            for panel in json.loads((ROOT / "grafana/dashboards" / name).read_text())["panels"]
            for target in panel.get("targets", [])]


def test_dashboard_reads_only_exported_metrics():
    exprs = dashboard_exprs()
    assert len(exprs) >= 10
    exported = exported_metric_names()
    for expr in exprs:
        names = METRIC.findall(expr)
        assert names, f"expression reads no tokenmill metric: {expr}"
        unknown = set(names) - exported
        assert not unknown, f"{expr} reads {sorted(unknown)}, which tokenmill does not export"
        assert expr.count("(") == expr.count(")"), f"unbalanced parentheses: {expr}"
    read = {name for expr in exprs for name in METRIC.findall(expr)}
    # what the issue asks the dashboard to show: TTFT and inter-token P50/P99, throughput, KV usage,
    # queue depth, errors
    for needed in ("tokenmill:time_to_first_token_seconds_bucket", "tokenmill:inter_token_latency_seconds_bucket",
                   "tokenmill:generation_tokens_total", "tokenmill:kv_cache_usage_perc",
                   "tokenmill:num_requests_waiting", "tokenmill:request_errors_total"):
        assert needed in read, needed
    assert any("histogram_quantile(0.5," in e and "time_to_first_token" in e for e in exprs)
    assert any("histogram_quantile(0.99," in e and "inter_token_latency" in e for e in exprs)


def test_dashboard_panels_use_the_provisioned_datasource():
    datasources = load_yaml("grafana/provisioning/datasources/datasources.yaml")["datasources"]
    uids = {source["uid"] for source in datasources}
    assert {"prometheus", "jaeger"} <= uids
    for name in DASHBOARDS:
        dashboard = json.loads((ROOT / "grafana/dashboards" / name).read_text())
        assert {panel["datasource"]["uid"] for panel in dashboard["panels"]} <= uids
    provider = load_yaml("grafana/provisioning/dashboards/dashboards.yaml")["providers"][0]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_prometheus_scrapes_the_three_processes_and_the_collector():
    config = load_yaml("prometheus.yml")
    targets = {target for job in config["scrape_configs"] for group in job["static_configs"]
               for target in group["targets"]}
    assert {"gateway:9400", "scheduler:9401", "worker:9402", "otel-collector:8889"} <= targets


def test_collector_pipelines_name_components_it_defines():
    config = load_yaml("otel-collector.yaml")
    assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    defined = {kind: set(config.get(kind, {})) for kind in ("receivers", "processors", "exporters", "connectors")}
    pipelines = config["service"]["pipelines"]
    assert {"traces", "metrics"} <= set(pipelines)
    for name, pipeline in pipelines.items():
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in defined[kind] | defined["connectors"], f"{name}: {kind} {component} undefined"
    assert "otlp/jaeger" in pipelines["traces"]["exporters"]
    prometheus_exporter = config["exporters"]["prometheus"]["endpoint"]
    assert prometheus_exporter.rpartition(":")[2] == "8889"  # what prometheus.yml scrapes


def test_dashboard_label_selectors_match_the_scrape_labels():
    config = load_yaml("prometheus.yml")
    components = {group["labels"]["component"] for job in config["scrape_configs"] for group in job["static_configs"]}
    selected = {match for expr in dashboard_exprs() for match in re.findall(r'component="([^"]+)"', expr)}
    assert selected and selected <= components
