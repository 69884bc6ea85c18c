"""Async scheduling on vs off against a real worker process over gRPC: `python scripts/bench_async_scheduling.py`.

Starts `python -m worker.main` (the default model unless --model), then runs the same batch of greedy
requests through the scheduler's EngineLoop, synchronous and pipelined, alternating, and prints wall
time, output tokens/s and how many plans reached the worker while it was still running a step.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from core.sampling import SamplingParams  # noqa: E402
from plumbing.rpc import WORKER_SERVICE  # noqa: E402
from protos.tokenmill.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.process.loop import EngineLoop  # noqa: E402
from scheduler.request import Request  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402
from scheduler.process.worker_client import WorkerClient  # noqa: E402
from tokenmill.cluster.child_process import ChildSpec  # noqa: E402
from tokenmill.cluster.readiness import free_port  # noqa: E402
from tokenmill.cluster.supervisor import Supervisor  # noqa: E402


async def run_batch(client: WorkerClient, async_scheduling: bool, args, tag: str) -> tuple[float, int]:
    config = SchedulerConfig(num_blocks=client.num_blocks, block_size=client.block_size)
    loop = EngineLoop(Scheduler(config), client, async_scheduling=async_scheduling)
    loop.start()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    streams = [loop.submit(Request(f"{tag}-{i}", [(i * 31 + j * 7) % 5000 + 10 for j in range(args.prompt_len)], params))
               for i in range(args.num_requests)]
    num_tokens = 0
    for stream in streams:
        while True:
            output = await stream.queue.get()
            num_tokens += len(output.new_token_ids)
            if output.finished:
                break
    elapsed = time.perf_counter() - started
    await loop.stop()
    return elapsed, num_tokens


async def steps_queued(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        return (await worker_pb2_grpc.WorkerStub(channel).Health(worker_pb2.HealthRequest())).num_steps_queued


async def main(args) -> None:
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    model = ["--model", args.model] if args.model else []
    spec = ChildSpec("worker", [sys.executable, "-m", "worker.main", "--port", address.split(":")[1], *model,
                                "--kv-cache-mb", "256"], WORKER_SERVICE, address,
                     env={"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")})
    with Supervisor([spec], echo=False):
        client = WorkerClient(address)
        await client.register(timeout_s=300)
        await run_batch(client, False, args, "warm")
        for round_index in range(args.rounds):
            for async_scheduling in (False, True):
                before = await steps_queued(address)
                elapsed, num_tokens = await run_batch(client, async_scheduling, args, f"r{round_index}{int(async_scheduling)}")
                queued = await steps_queued(address) - before
                print(f"async_scheduling={str(async_scheduling):5} {elapsed:7.2f} s {num_tokens / elapsed:8.1f} tok/s "
                      f"plans queued on the worker: {queued}", flush=True)
        await client.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    asyncio.run(main(parser.parse_args()))
