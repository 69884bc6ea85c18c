"""Time one decode step of ModelRunner over N concurrent requests on the real default model.

Not a test: prints milliseconds per decode step at a few context lengths.
    python3 scripts/bench_decode_step.py --requests 32 --contexts 128 256 384
Each request starts with context-1 tokens already counted as cached (no prefill is run), then
--steps decode steps are timed; the median is reported.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from core.step import CachedRequestData, NewRequestData, StepPlan
from core.sampling import SamplingParams
from worker.loader import load_model
from worker.model_runner import ModelRunner


def bench(runner: ModelRunner, num_requests: int, context_len: int, steps: int, step_id: int) -> tuple[float, int]:
    """Requests arrive as if context_len - 1 tokens were prefix-cache hits (the cache holds zeros, which
    costs the same to attend over), so every timed step is a pure decode step."""
    blocks_per_request = -(-(context_len + steps) // runner.block_size)
    generator = torch.Generator().manual_seed(context_len)
    ids = [f"r{context_len}-{i}" for i in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1)
    new = []
    for i, request_id in enumerate(ids):
        prompt = torch.randint(0, runner.model_config.vocab_size, (context_len,), generator=generator).tolist()
        table = list(range(i * blocks_per_request, (i + 1) * blocks_per_request))
        new.append(NewRequestData(request_id, prompt, len(prompt), params, table, context_len - 1))
    timings = []
    for step in range(steps + 1):
        step_id += 1
        cached = [CachedRequestData(rid, [], context_len - 1 + step) for rid in ids] if step else []
        plan = StepPlan(step_id, new_requests=new if not step else [], cached_requests=cached)
        plan.num_scheduled_tokens = {rid: 1 for rid in ids}
        started = time.perf_counter()
        runner.execute(plan)
        if step:  # the first step also builds the runner's request state
            timings.append(time.perf_counter() - started)
    step_id += 1
    runner.execute(StepPlan(step_id, finished_request_ids=ids))
    return statistics.median(timings) * 1e3, step_id


def bench_prefill(runner: ModelRunner, num_requests: int, prompt_len: int, step_id: int) -> tuple[float, int]:
    """One step that prefills num_requests whole prompts; returns (ms, step_id)."""
    blocks_per_request = -(-prompt_len // runner.block_size)
    params = SamplingParams(temperature=0.0)
    new = [
        NewRequestData(f"p{i}", list(range(100, 100 + prompt_len)), prompt_len, params, list(range(i * blocks_per_request, (i + 1) * blocks_per_request)), 0)
        for i in range(num_requests)
    ]
    started = time.perf_counter()
    runner.execute(StepPlan(step_id + 1, new_requests=new, num_scheduled_tokens={r.request_id: prompt_len for r in new}))
    elapsed_ms = (time.perf_counter() - started) * 1e3
    runner.execute(StepPlan(step_id + 2, finished_request_ids=[r.request_id for r in new]))
    return elapsed_ms, step_id + 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 384])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-requests", type=int, default=8, help="also time one step prefilling this many prompts")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, config = load_model(None, torch.float32, progress=False)
    blocks_per_request = -(-(max(args.contexts) + args.steps) // args.block_size)
    runner = ModelRunner(model, config, args.requests * blocks_per_request, args.block_size, torch.float32)
    runner.warm_up()
    step_id = 0
    print(f"threads={torch.get_num_threads()} requests={args.requests} block_size={args.block_size}")
    for context_len in args.contexts:
        ms, step_id = bench(runner, args.requests, context_len, args.steps, step_id)
        print(f"context {context_len}: decode step {ms:.1f} ms  ({args.requests / ms * 1e3:.0f} tok/s)")
    if args.prefill_requests:
        _, step_id = bench_prefill(runner, args.prefill_requests, args.prompt_len, step_id)  # first one pays allocations
        ms, step_id = bench_prefill(runner, args.prefill_requests, args.prompt_len, step_id)
        num_tokens = args.prefill_requests * args.prompt_len
        print(f"prefill step of {args.prefill_requests} x {args.prompt_len} tokens: {ms:.0f} ms  ({num_tokens / ms * 1e3:.0f} tok/s)")


if __name__ == "__main__":
    main()
