"""Async scheduling against the real worker process over gRPC: the worker receives step N+1 while it
runs step N, and greedy outputs are token for token those of the synchronous loop."""
from __future__ import annotations

from core.outputs import FinishReason
import asyncio
import sys

import grpc

from protos.tokenmill.v1 import worker_pb2, worker_pb2_grpc
from scheduler.config import SchedulerConfig
from scheduler.process.loop import EngineLoop
from core.sampling import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.process.worker_client import WorkerClient
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill.cluster.child_process import ChildSpec
from tokenmill.cluster.readiness import free_port
from plumbing.rpc import WORKER_SERVICE
from tokenmill.cluster.supervisor import Supervisor

# different lengths; a budget of 24 tokens splits the longer prompts into chunks mixed with decodes
PROMPT_LENGTHS = [5, 30, 17, 41, 9]
MAX_TOKENS = [6, 12, 3, 8, 10]


def prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 120 + 3 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]


async def generate(client: WorkerClient, async_scheduling: bool, tag: str, stop_token_ids=()) -> dict:
    config = SchedulerConfig(num_blocks=client.num_blocks, block_size=client.block_size,
                             max_num_batched_tokens=24, max_model_len=256)
    loop = EngineLoop(Scheduler(config), client, async_scheduling=async_scheduling)
    loop.start()
    streams = {}
    for i, (prompt, max_tokens) in enumerate(zip(prompts(), MAX_TOKENS)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_token_ids=tuple(stop_token_ids))
        streams[i] = loop.submit(Request(f"{tag}-{i}", prompt, params))
    results = {}
    for i, stream in streams.items():
        outputs = [await asyncio.wait_for(stream.queue.get(), 60)]
        while not outputs[-1].finished:
            outputs.append(await asyncio.wait_for(stream.queue.get(), 60))
        results[i] = ([t for o in outputs for t in o.new_token_ids], outputs[-1].finish_reason)
    await loop.stop()
    assert loop.scheduler.kv.pool.num_used == 0
    return results


async def num_steps_queued(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        health = await worker_pb2_grpc.WorkerStub(channel).Health(worker_pb2.HealthRequest(), timeout=10)
    return health.num_steps_queued


async def test_async_scheduling_matches_sync_and_the_worker_gets_plans_ahead(tmp_path):
    folder, _ = make_tiny_hf_model(tmp_path, "llama_gqa")
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    spec = ChildSpec("worker", [sys.executable, "-m", "worker.main", "--port", address.split(":")[1],
                                "--model", str(folder), "--block-size", "16", "--kv-cache-mb", "1"],
                     WORKER_SERVICE, address)
    with Supervisor([spec], echo=False):
        client = WorkerClient(address)
        await client.register(timeout_s=120)
        free_running = await generate(client, False, "a")
        stop = free_running[1][0][4]  # request 1 stops at its 5th token (others may stop on it too)
        expected = await generate(client, False, "b", stop_token_ids=(stop,))
        assert expected[1] == (free_running[1][0][:5], FinishReason.STOP)
        assert await num_steps_queued(address) == 0  # synchronous: a plan leaves only after a result
        ours = await generate(client, True, "c", stop_token_ids=(stop,))
        assert ours == expected
        assert {reason for _, reason in ours.values()} == {FinishReason.STOP, FinishReason.LENGTH}
        # plans that reached the worker while it still ran the previous step
        assert await num_steps_queued(address) >= 5
        await client.close()
