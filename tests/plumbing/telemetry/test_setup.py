"""Tracing set-up from the environment: off unless an OTLP endpoint is configured, and off means
nothing installed, nothing exported, nothing printed."""
from __future__ import annotations

import subprocess
import sys

import pytest

from core.step import CachedRequestData, NewRequestData, StepPlan
from core.sampling import SamplingParams
from plumbing.telemetry.tracing import tracing_requested
from worker.step_telemetry import step_kind


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, False),
    ({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, False),  # nowhere to send them
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, True),  # the exporter's default, localhost:4317
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_TRACES_EXPORTER": "none"}, False),
])
def test_tracing_is_requested_only_with_an_endpoint(environ, expected):
    assert tracing_requested(environ) is expected


def test_unconfigured_process_installs_nothing_and_prints_nothing():
    """A fresh interpreter without OTEL_* runs a traced code path: no SDK, no patched gRPC, silence."""
    script = """
import asyncio, grpc, logging
from opentelemetry import trace
from plumbing.telemetry.tracing import current_traceparent, tracer
from plumbing.telemetry.tracing_setup import setup_tracing
from plumbing.telemetry.logs import configure_logging
configure_logging("json")
original = grpc.aio.server
assert setup_tracing("gateway") is False
assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
assert grpc.aio.server is original
with tracer().start_as_current_span("x") as span:
    assert not span.is_recording() and current_traceparent() == ""
print("ok")
"""
    environ = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "."}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environ, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ok\n" and done.stderr == ""


def _plan(new: dict[str, int], cached: dict[str, int]) -> StepPlan:
    plan = StepPlan(step_id=1)
    for request_id, num_tokens in new.items():
        plan.new_requests.append(NewRequestData(request_id, [1] * num_tokens, num_tokens, SamplingParams(), [0], 0))
        plan.num_scheduled_tokens[request_id] = num_tokens
    for request_id, num_tokens in cached.items():
        plan.cached_requests.append(CachedRequestData(request_id, [], 4))
        plan.num_scheduled_tokens[request_id] = num_tokens
    return plan


def test_step_kind():
    assert step_kind(_plan({"a": 5}, {})) == "prefill"
    assert step_kind(_plan({"a": 1}, {})) == "prefill"  # a one-token prompt is still its prefill
    assert step_kind(_plan({}, {"b": 8})) == "prefill"  # a later chunk of a chunked prefill
    assert step_kind(_plan({}, {"b": 1, "c": 1})) == "decode"
    assert step_kind(_plan({"a": 5}, {"b": 1})) == "mixed"
