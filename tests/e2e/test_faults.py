"""Faults on a real cluster (tiny random model): deadlines, cancellation, a worker killed with -9
mid-generation, the scheduler killed with -9, Redis stopped, the gateway restarted mid-stream,
SIGTERM drain. One cluster for the module; each test leaves it serving (the supervisor restarts what
a test kills) and waits for that before it ends."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.faults_cluster import generate_ok, kill9, request, scheduler_load, tiny_cluster, wait_until

pytestmark = pytest.mark.slow

LONG = 300  # tokens: a few seconds of decoding on a loaded CPU, so a fault lands mid-generation


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with tiny_cluster(tmp_path_factory.mktemp("faults")) as running:
        yield running


async def collect(call) -> tuple[list[int], generation_pb2.GenerateStreamResponse | None]:
    ids, last = [], None
    async for message in call:
        ids += message.token_ids
        last = message
    return ids, last


async def test_deadline_in_the_queue_and_mid_generation_ends_with_deadline_exceeded_and_frees_pages(cluster):
    config, _ = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # mid-generation: 480 tokens take seconds on a CPU, the first ones arrive within milliseconds
        call = stub.GenerateStream(request("deadline", 480, "deadline-mid"), timeout=1.0)
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for message in call:
                received += message.token_ids
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0 < len(received) < 480
        # in the queue: a deadline too short for the request ever to be scheduled
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Generate(request("deadline", LONG, "deadline-queued"), timeout=0.001)
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    async def pages_free():
        load = await scheduler_load(config.scheduler_address)
        return load.num_running_requests == 0 and load.num_waiting_requests == 0 and load.num_kv_pages_used == 0

    await wait_until(pages_free, 30, "deadline-exceeded requests leaving the scheduler")


async def test_worker_killed_mid_generation_is_restarted_and_requests_finish_by_recompute(cluster):
    config, supervisor = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        undisturbed, _ = await collect(stub.GenerateStream(request("The worker dies", LONG)))
        old_pid = supervisor.pid("worker")
        call = stub.GenerateStream(request("The worker dies", LONG, "survives-worker-kill"))
        ids = []
        async for message in call:
            ids += message.token_ids
            if len(ids) >= 5 and supervisor.pid("worker") == old_pid:
                kill9(supervisor, "worker")
            if message.finish_reason:
                break
        assert supervisor.pid("worker") != old_pid, "the supervisor restarted the worker"
        assert ids == undisturbed, "recompute after the restart continues the greedy output exactly"
        assert message.finish_reason == common_pb2.FINISH_REASON_LENGTH
        status = await stub.GetRequestStatus(generation_pb2.GetRequestStatusRequest(request_id="survives-worker-kill"))
        assert status.num_preemptions >= 1, "the request was re-queued, not finished before the kill"
    assert await wait_until(lambda: generate_ok(config.gateway_address), 60, "serving after the worker restart")
