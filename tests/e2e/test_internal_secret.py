"""A cluster started the way `tokenmill serve` starts one (its flags through cli.serve_security_options,
then ClusterConfig + Supervisor) on a tiny model: it serves a request, while a local process calling the
scheduler's Submit or the worker's ExecuteStep without the cluster's internal secret is UNAUTHENTICATED;
health checks still answer; the secret reaches each server through its environment, never its argv."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plumbing.internal_secret import ENV_VAR, METADATA_KEY
from plumbing.rpc import SCHEDULER_SERVICE, WORKER_SERVICE
from plumbing.tls import aio_channel
from protos.tokenmill.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill import cli
from tokenmill.client import Client
from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings
from tokenmill.cluster.specs import cluster_specs
from tokenmill.cluster.supervisor import Supervisor

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served_cluster(tmp_path_factory):
    model, _ = make_tiny_hf_model(tmp_path_factory.mktemp("model"))
    serve_flags = cli.build_parser().parse_args(["serve"])
    config = resolve_ports(with_settings(ClusterConfig(), **cli.serve_security_options(serve_flags), model=str(model),
                                         gateway_port=0, scheduler_port=0, worker_port=0, redis_port=0, kv_cache_mb=4))
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300) as supervisor:
        yield config, supervisor


async def _refusal(address: str, server: str) -> grpc.aio.AioRpcError:
    """The error of a call without the secret: Submit to the scheduler, ExecuteStep to the worker."""
    async with aio_channel(address, None) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            if server == "scheduler":
                async for _ in scheduler_pb2_grpc.SchedulerStub(channel).Submit(scheduler_pb2.SubmitRequest(
                        request_id="intruder", prompt_token_ids=[1, 2, 3], owner="alice"), timeout=30):
                    pass
            else:
                await worker_pb2_grpc.WorkerStub(channel).ExecuteStep(worker_pb2.StepPlan(step_id=1), timeout=30)
    return caught.value


def test_the_cluster_serves_a_request(served_cluster):
    config, _ = served_cluster
    with Client(config.gateway_address, timeout=120) as client:
        assert client.generate("Hello", max_tokens=4, temperature=0, ignore_eos=True).usage.completion_tokens == 4


@pytest.mark.parametrize("server, method", [("scheduler", "Submit"), ("worker", "ExecuteStep")])
async def test_a_call_without_the_secret_is_unauthenticated_while_health_answers(served_cluster, server, method):
    config, _ = served_cluster
    address = {"scheduler": config.scheduler_address, "worker": config.worker_address}[server]
    error = await _refusal(address, server)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error.details()
    assert f"{method} on the {server} needs this cluster's internal secret" in error.details()
    assert METADATA_KEY in error.details() and config.internal_secret not in error.details()
    async with aio_channel(address, None) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(
            service={"scheduler": SCHEDULER_SERVICE, "worker": WORKER_SERVICE}[server]), timeout=30)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_each_cluster_has_its_own_secret_in_the_environment_never_on_a_command_line(served_cluster):
    config, supervisor = served_cluster
    serve_flags = cli.build_parser().parse_args(["serve"])
    assert len(config.internal_secret) >= 32
    assert cli.serve_security_options(serve_flags)["internal_secret"] != config.internal_secret
    for name in ("worker", "scheduler", "gateway"):
        pid = supervisor.children[name].pid
        command_line = Path(f"/proc/{pid}/cmdline").read_bytes()
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert config.internal_secret.encode() not in command_line, name
        assert f"{ENV_VAR}={config.internal_secret}".encode() in environment, name
