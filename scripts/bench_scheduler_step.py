"""The scheduler's per-step Python cost at 256-1,024 running requests: `python scripts/bench_scheduler_step.py`.

Drives the real Scheduler through the real StepPipeline (async scheduling, depth 2, as the service
runs it) with a fake model that samples a fixed token (no KV, no compute: only the scheduler's own
cost is left), and hands each step's outputs to the process's RequestStreams with the real Redis
writers behind them (a redis-server is started on a free port unless --redis-url is given). Each
step sleeps --step-ms, as a worker's forward pass would, so the writers flush in the background at
their own pace. Per step and per output token it prints the CPU time of:

    schedule   pipeline.send_next: Scheduler.schedule() + assume_done, the plan built
    wire       the plan serialized as the gRPC client sends it, the worker's reply parsed
    apply      pipeline.apply: Scheduler.update_assumed() over the result, the outputs built
    deliver    RequestStreams.deliver: streams, progress records, token-stream entries queued
    redis      the writers' background flushes (record batches, token streams): the process's CPU
               outside the three above
    round trips per step: the writers' calls to Redis over the steps

Each size runs twice, side by side: `script` (the token-stream writer as it is: one script call per
flush) and `pipeline` (the write path before issue 33: an XADD + EXPIRE per entry in a pipeline).
`--redis-only` times just one flush of N entries each way.
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.sampling import SamplingParams  # noqa: E402
from core.step import StepPlan, StepResult  # noqa: E402
from kvstore.state_writer import RequestStateWriter  # noqa: E402
from plumbing.process import settle_heap  # noqa: E402
from protos import codec  # noqa: E402
from protos.tokenmill.v1 import worker_pb2  # noqa: E402
from kvstore.token_streams import TokenStreamWriter, token_stream_key  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.process.request_streams import RequestStreams  # noqa: E402
from scheduler.request import Request  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402
from scheduler.step_pipeline import ASYNC_SCHEDULING, StepPipeline  # noqa: E402

SAMPLED_TOKEN = 7  # never EOS: requests run to max_tokens


class FakeModel:
    """Samples SAMPLED_TOKEN for each request whose scheduled tokens reach the end of what it has (a
    prompt chunk short of it samples nothing), like tests/helpers/fake_executor.py without the KV."""

    def __init__(self) -> None:
        self.tokens_left: dict[str, int] = {}  # request id -> tokens to compute before it samples

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self.tokens_left.pop(request_id, None)
        for new in plan.new_requests:
            self.tokens_left[new.request_id] = len(new.token_ids) - new.num_computed_tokens
        sampled = {}
        for request_id, num_scheduled in plan.num_scheduled_tokens.items():
            left = self.tokens_left.get(request_id, 1) - num_scheduled
            if left <= 0:
                sampled[request_id], left = SAMPLED_TOKEN, 1
            self.tokens_left[request_id] = left
        return StepResult(plan.step_id, sampled)


class PipelineTokenStreamWriter(TokenStreamWriter):
    """The token-stream write path before issue 33, kept here to compare: per entry an XADD and an
    EXPIRE, all in one pipeline."""

    async def _flush(self) -> bool:
        batch = list(self._pending)
        pipe = self._client.pipeline(transaction=False)
        for request_id, fields in batch:
            pipe.xadd(token_stream_key(request_id), fields)
            pipe.expire(token_stream_key(request_id), self._ttl_s)
        self.round_trips += 1
        await pipe.execute()
        for _ in batch:
            self._pending.popleft()
        return True


def writer_class(variant: str) -> type[TokenStreamWriter]:
    return PipelineTokenStreamWriter if variant == "pipeline" else TokenStreamWriter


def fill(num_requests: int, args) -> tuple[Scheduler, StepPipeline, RequestStreams, FakeModel]:
    """A scheduler with num_requests running requests, all past their prompts."""
    max_tokens = args.warmup_steps + args.steps + 8
    pages_each = -(-(args.prompt_len + max_tokens) // 16) + 1
    config = SchedulerConfig(num_blocks=num_requests * pages_each, block_size=16, max_num_seqs=num_requests,
                             max_num_batched_tokens=num_requests * args.prompt_len, max_model_len=4096)
    scheduler, model = Scheduler(config), FakeModel()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for index in range(num_requests):
        prompt = [(index * 31 + position * 7) % 5000 + 10 for position in range(args.prompt_len)]
        scheduler.add_request(Request(f"req-{index:05d}", prompt, params))
    settle_heap()  # as the scheduler process once it serves (its collector settings count in every part)
    return scheduler, StepPipeline(scheduler, ASYNC_SCHEDULING), RequestStreams(), model


PARTS = ("schedule", "wire", "apply", "deliver", "redis")


def one_step(pipeline: StepPipeline, streams: RequestStreams, model: FakeModel, spent: dict[str, float]) -> int:
    """Runs a step, adding each part's CPU seconds to spent; returns the output tokens it delivered."""
    started = time.process_time()
    sent = pipeline.send_next(model.execute)
    scheduled = time.process_time()
    step = pipeline.oldest_to_collect(sent)
    result_bytes = b""
    if step is not None:
        result_bytes = codec.step_result_to_proto(step.pending, columns=True).SerializeToString()  # the worker's part
    wire_started = time.process_time()
    if sent is not None:
        codec.step_plan_to_proto(sent, columns=True).SerializeToString()  # as to a worker of columnar_steps
    if step is not None:
        codec.step_result_from_proto(worker_pb2.StepResult.FromString(result_bytes))
    wired = time.process_time()
    outputs = pipeline.apply(step.pending) if step is not None else []
    applied = time.process_time()
    streams.deliver(outputs, forward_ns=0)
    delivered = time.process_time()
    spent["schedule"] += scheduled - started
    spent["wire"] += wired - wire_started
    spent["apply"] += applied - wired
    spent["deliver"] += delivered - applied
    return sum(len(output.new_token_ids) for output in outputs)


async def run_size(num_requests: int, variant: str, redis_url: str, args) -> dict[str, float]:
    scheduler, pipeline, streams, model = fill(num_requests, args)
    state = RequestStateWriter(redis_url)
    tokens = writer_class(variant)(redis_url)
    streams.state, streams.tokens = state, tokens
    for request in list(scheduler.waiting):
        streams.open(request, deadline=None, resumable=True, owner=None)
    state.start()
    tokens.start()
    for _ in range(args.warmup_steps):  # the prompts: every request decodes from here on
        one_step(pipeline, streams, model, dict.fromkeys(PARTS, 0.0))
        await asyncio.sleep(args.step_ms / 1e3)
    spent = dict.fromkeys(PARTS, 0.0)
    num_tokens, trips_before, cpu_before = 0, state.stats.batches + tokens.round_trips, time.process_time()
    for _ in range(args.steps):
        num_tokens += one_step(pipeline, streams, model, spent)
        await asyncio.sleep(args.step_ms / 1e3)  # the worker's forward pass: the writers flush meanwhile
    await asyncio.sleep(0.1)  # the last flushes
    # the writers' flushes: the process's CPU outside the parts timed (the timing's own cost is in it too)
    spent["redis"] = time.process_time() - cpu_before - sum(spent.values())
    trips = state.stats.batches + tokens.round_trips - trips_before
    await state.aclose()
    await tokens.aclose()
    return {**{name: value / args.steps * 1e6 for name, value in spent.items()},
            **{f"{name}/tok": value / max(num_tokens, 1) * 1e6 for name, value in spent.items()},
            "round_trips_per_step": trips / args.steps}


async def flush_once(num_entries: int, variant: str, redis_url: str, repeats: int) -> float:
    """Client CPU microseconds of one token-stream flush of num_entries entries."""
    writer = writer_class(variant)(redis_url)
    total = 0.0
    for _ in range(repeats):
        for index in range(num_entries):
            writer.append(f"req-{index:05d}", 100, [SAMPLED_TOKEN])
        started = time.process_time()
        await writer._flush()  # the flush alone, without the background task's interval
        total += time.process_time() - started
    await writer.aclose()
    return total / repeats * 1e6


def start_redis() -> tuple[subprocess.Popen, str]:
    from tokenmill.cluster.readiness import free_port

    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not on PATH: install it or pass --redis-url")
    port = free_port()
    process = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                               stdout=subprocess.DEVNULL)
    time.sleep(0.3)
    return process, f"redis://127.0.0.1:{port}/0"


async def main(args) -> None:
    redis, url = (None, args.redis_url) if args.redis_url else start_redis()
    try:
        for num_requests in args.sizes:
            for variant in ("script", "pipeline"):
                if args.redis_only:
                    cpu_us = await flush_once(num_requests, variant, url, repeats=20)
                    print(f"n={num_requests:5d} {variant:8s} one flush: {cpu_us:8.0f} us CPU "
                          f"({cpu_us / num_requests:5.2f} us per entry)", flush=True)
                    continue
                figures = await run_size(num_requests, variant, url, args)
                print(f"n={num_requests:5d} {variant:8s} us/step " + " ".join(
                    f"{name} {figures[name]:7.0f}" for name in PARTS)
                    + " | us/token " + " ".join(f"{name} {figures[name + '/tok']:5.2f}" for name in PARTS)
                    + f" total {sum(figures[name + '/tok'] for name in PARTS):5.2f}"
                    + f" | round trips/step {figures['round_trips_per_step']:.2f}", flush=True)
    finally:
        if redis is not None:
            redis.terminate()
            redis.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024], help="running requests")
    parser.add_argument("--steps", type=int, default=100, help="decode steps timed per size")
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps before timing (the prompts)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--step-ms", type=float, default=20.0, help="the fake forward pass's wall time")
    parser.add_argument("--redis-url", default="", help="an existing Redis (default: start a redis-server)")
    parser.add_argument("--redis-only", action="store_true", help="time one token-stream flush each way only")
    asyncio.run(main(parser.parse_args()))
