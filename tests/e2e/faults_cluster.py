"""A real cluster on a tiny random model for the fault tests: redis-server, worker, scheduler and
gateway as separate processes, worker/scheduler/gateway restarted by the supervisor when they crash.

    with tiny_cluster(tmp_path, retry_on_worker_failure=False) as (config, supervisor): ...
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import time

import grpc
import pytest

from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings
from tokenmill.cluster.specs import cluster_specs, restart_policies
from tokenmill.cluster.restart_policy import RestartPolicy
from tokenmill.cluster.supervisor import Supervisor

# restarts come quickly in tests; a crash loop still ends the cluster
FAST_RESTARTS = RestartPolicy(backoff_initial_s=0.2, backoff_max_s=2.0, max_restarts=5, window_s=120.0)


@contextlib.contextmanager
def tiny_cluster(tmp_path, model_overrides: dict | None = None, extra_argv: dict[str, list[str]] | None = None,
                 **overrides):
    """model_overrides: the tiny model's config attributes (e.g. max_position_embeddings); extra_argv:
    flags added to a child's command line by its name ("gateway", "scheduler", ...); overrides:
    settings of the cluster or a service (with_settings; num_blocks=None: the KV cache sized from memory)."""
    folder, _ = make_tiny_hf_model(tmp_path, **(model_overrides or {}))
    settings = {"num_blocks": 256, "max_num_batched_tokens": 256, **overrides}
    config = resolve_ports(with_settings(ClusterConfig(), model=str(folder), gateway_port=0, scheduler_port=0,
                                         worker_port=0, redis_port=0, **settings))
    specs = [dataclasses.replace(spec, argv=[*spec.argv, *(extra_argv or {}).get(spec.name, [])])
             for spec in cluster_specs(config)]
    # every child's output and the supervisor's own lines (restarts) go to a file a failing test names
    with open(tmp_path / "cluster.log", "w", buffering=1) as log:
        supervisor = Supervisor(specs, echo=log, startup_timeout_s=300,
                                restart_policies=restart_policies(FAST_RESTARTS))
        with supervisor:
            yield config, supervisor


def request(prompt: str, max_tokens: int, request_id: str = "", **params) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt=prompt, request_id=request_id,
        parameters=generation_pb2.GenerateParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params))


def kill9(supervisor: Supervisor, name: str) -> None:
    """A crash, not a stop: the supervisor did not ask for it, so it restarts the child."""
    os.kill(supervisor.pid(name), signal.SIGKILL)


async def wait_until(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    """Polls an async predicate until it returns something truthy; generous timeouts for loaded CI."""
    deadline = time.monotonic() + timeout_s
    last_error = None
    while time.monotonic() < deadline:
        try:
            result = await predicate()
            if result:
                return result
        except grpc.aio.AioRpcError as error:
            last_error = error
        await asyncio.sleep(interval_s)
    raise AssertionError(f"{what} not within {timeout_s}s (last error: {last_error})")


async def generate_ok(address: str, prompt: str = "ping", max_tokens: int = 2):
    """One successful Generate through the gateway, or None (for wait_until)."""
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await generation_pb2_grpc.GenerationStub(channel).Generate(request(prompt, max_tokens), timeout=10)
    return reply if len(reply.token_ids) == max_tokens else None


async def scheduler_load(address: str) -> scheduler_pb2.GetLoadResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await scheduler_pb2_grpc.SchedulerStub(channel).GetLoad(
            scheduler_pb2.GetLoadRequest(include_running_request_ids=True), timeout=5)


@pytest.fixture(autouse=True)
def cluster_log_on_failure(cluster_dir):
    """Imported by a test module whose module-scoped cluster_dir holds the cluster: after each test, the
    log's tail, which pytest shows only for a failed test, where it tells whether a restarted child came
    back, crashed again or was given up."""
    yield
    print_cluster_log_tail(cluster_dir)


def print_cluster_log_tail(tmp_dir, num_lines: int = 60) -> None:
    path = tmp_dir / "cluster.log"
    if path.exists():
        lines = path.read_text(errors="replace").splitlines()[-num_lines:]
        print(f"--- last {len(lines)} lines of {path}:\n" + "\n".join(lines))
