"""A worker whose KV cache is sized from memory (the default) killed with -9 while 16 requests stream
(issue 31 item 3): the supervisor restarts it, it reuses the page count its first start recorded, the
scheduler takes it back at once, and all 16 requests finish by recompute. Before, the restart sized
afresh from the memory free then, the scheduler refused the other count for 60 s and failed them all."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from plumbing.tls import ClusterTLS
from protos.tokenmill.v1 import common_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e.faults_cluster import (cluster_log_on_failure, generate_ok, kill9, request,  # noqa: F401 (a fixture)
                                      scheduler_load, tiny_cluster, wait_until)
from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings
from tokenmill.cluster.specs import KV_SIZING_RECORD, cluster_specs
from worker.kv_sizing import REUSED_SIZING

pytestmark = pytest.mark.slow

NUM_REQUESTS, MAX_TOKENS = 16, 200


@pytest.fixture(scope="module")
def cluster_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("restart-sizing")


@pytest.fixture(scope="module")
def cluster(cluster_dir):
    # a small share of the RAM available: the page count moves with whatever else runs on the machine
    with tiny_cluster(cluster_dir, num_blocks=None, kv_cache_memory_fraction=0.0005) as running:
        yield running


async def capacity(address: str) -> worker_pb2.GetCapacityResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        return await worker_pb2_grpc.WorkerStub(channel).GetCapacity(worker_pb2.GetCapacityRequest(), timeout=10)


async def test_worker_sized_from_memory_restarts_with_the_same_pages_and_every_request_finishes(cluster):
    config, supervisor = cluster
    first = await capacity(config.worker_address)
    assert first.kv_cache_sizing.startswith("0.0005 x (") and first.num_blocks >= 64
    old_pid, received = supervisor.pid("worker"), [0]

    async def generate(stub, index: int):
        ids, last = [], None
        async for message in stub.GenerateStream(request(f"request {index} outlives the worker", MAX_TOKENS)):
            ids += message.token_ids
            last = message
            received[0] += len(message.token_ids)
            if received[0] >= NUM_REQUESTS * 10 and supervisor.pid("worker") == old_pid:
                kill9(supervisor, "worker")  # every request is running, none is finished
        return ids, last

    started = time.monotonic()
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        results = await asyncio.wait_for(asyncio.gather(*(generate(stub, i) for i in range(NUM_REQUESTS))), 120)
    assert supervisor.pid("worker") != old_pid, "the worker was killed and restarted"
    finished = [last.finish_reason for ids, last in results if len(ids) == MAX_TOKENS]
    assert finished == [common_pb2.FINISH_REASON_LENGTH] * NUM_REQUESTS, "all 16 finish, none fails"
    assert time.monotonic() - started < 60, "no reconnect timeout was waited out"

    again = await capacity(config.worker_address)
    assert again.num_blocks == first.num_blocks
    assert again.kv_cache_sizing.startswith(f"{REUSED_SIZING}: {first.num_blocks} pages")
    load = await scheduler_load(config.scheduler_address)
    assert load.num_kv_pages_total == first.num_blocks and load.num_kv_pages_used == 0
    assert await wait_until(lambda: generate_ok(config.gateway_address), 30, "serving after the restart")


def test_a_worker_sized_from_memory_keeps_its_record_in_its_temp_dir_with_absolute_paths(monkeypatch, tmp_path):
    """The record lives in the worker's temp dir (its cwd, kept across crash restarts), so the paths it
    is given are made absolute; a worker with a fixed size gets neither."""
    monkeypatch.chdir(tmp_path)
    tls = ClusterTLS("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
    ports = {"gateway_port": 0, "scheduler_port": 0, "worker_port": 0, "redis_port": 0}

    def worker_spec(**settings):
        config = resolve_ports(with_settings(ClusterConfig(), **ports, **settings))
        return next(spec for spec in cluster_specs(config) if spec.name == "worker")

    spec = worker_spec(model="tiny.gguf", tls=tls)
    argv = list(spec.argv)
    assert spec.use_temp_dir and argv[argv.index("--kv-sizing-record") + 1] == KV_SIZING_RECORD
    assert argv[argv.index("--model") + 1] == str(tmp_path / "tiny.gguf")
    assert argv[argv.index("--tls-cert") + 1] == str(tmp_path / "server.pem")
    assert argv[argv.index("--tls-client-ca") + 1] == str(tmp_path / "ca.pem")
    fixed = worker_spec(model="tiny.gguf", tls=tls, num_blocks=64)
    assert not fixed.use_temp_dir and "--kv-sizing-record" not in fixed.argv and "tiny.gguf" in fixed.argv
