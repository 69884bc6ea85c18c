"""Time one decode step of ModelRunner over N concurrent requests on the real default model, as served
(the weights in the file's formats, the compiled CPU ops, --dtype auto unless told).

Not a test: prints milliseconds per decode step at a few context lengths; --profile adds a torch
profiler table of one context's steps.
    python3 scripts/bench_decode_step.py --requests 32 --contexts 128 256 384
    OMP_NUM_THREADS=2 GOMP_SPINCOUNT=30000 python3 scripts/bench_decode_step.py --contexts 160 --dtype bfloat16 --profile
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


def ab_float32_rows(runner: ModelRunner, num_requests: int, context_len: int, steps: int, rounds: int,
                    step_id: int) -> int:
    import worker.linears.group_quant as group_quant

    served = group_quant.GroupQuantLinear.forward

    def float32_rows(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.bfloat16 and x.shape[0] <= group_quant.GEMM_ROWS:
            return served(self, x.float()).to(torch.bfloat16)
        return served(self, x)

    results: dict[str, list[float]] = {"bfloat16 rows": [], "float32 rows": []}
    try:
        for _ in range(rounds):
            for label, forward in (("float32 rows", float32_rows), ("bfloat16 rows", served)):
                group_quant.GroupQuantLinear.forward = forward
                ms, step_id = bench(runner, num_requests, context_len, steps, step_id)
                results[label].append(ms)
    finally:
        group_quant.GroupQuantLinear.forward = served
    for label, values in results.items():
        print(f"A/B {label}: decode step median {statistics.median(values):.2f} ms over {rounds} rounds "
              f"(min {min(values):.2f}, max {max(values):.2f})")
    return step_id


def main() -> None:
    from dataclasses import replace

    from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 256, 384])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-requests", type=int, default=8, help="also time one step prefilling this many prompts")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 where the CPU has it) | float32 | bfloat16")
    parser.add_argument("--quantization", default="auto", help="auto: the GGUF's formats as stored | none | int8 | int4")
    parser.add_argument("--cpu-int8-activations", action="store_true")
    parser.add_argument("--cpu-dense-weights", default="auto", choices=("auto", "on", "off"),
                        help="dense copies of the quantized weights for steps of 5 rows or more (worker.linears.dense_weights)")
    parser.add_argument("--profile", action="store_true", help="a torch profiler table of the last context's steps")
    parser.add_argument("--ab-float32-rows", type=int, default=0, metavar="ROUNDS",
                        help="A/B in this process, ROUNDS alternations at the last context: bfloat16 activations "
                             "into the row op as served, against converted to float32 and back around it (as before "
                             "the op's bfloat16 kernel); separate processes differ by more than the change")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    blocks_per_request = -(-(max(args.contexts) + args.steps) // args.block_size)
    # the pool holds the decode requests' blocks or the prefill's, whichever needs more (the prefill step
    # runs after the decode steps have freed theirs)
    prefill_blocks = args.prefill_requests * -(-args.prompt_len // args.block_size)
    llm = LLM(EngineConfig(worker=replace(
        ENGINE_WORKER, dtype=args.dtype, quantization=args.quantization, block_size=args.block_size,
        num_blocks=max(args.requests * blocks_per_request, prefill_blocks) + 1,
        cpu_int8_activations=args.cpu_int8_activations, cpu_dense_weights=args.cpu_dense_weights)))
    runner = llm.runner
    step_id = 10**6  # past the engine's own warm-up steps
    print(f"threads={torch.get_num_threads()} requests={args.requests} block_size={args.block_size} "
          f"dtype={args.dtype} quantization={args.quantization} cpu_dense_weights={args.cpu_dense_weights}")
    for context_len in args.contexts:
        bench(runner, args.requests, context_len, 2, step_id)  # warm: first steps at a shape pay allocations
        step_id += 10
        ms, step_id = bench(runner, args.requests, context_len, args.steps, step_id)
        print(f"context {context_len}: decode step {ms:.1f} ms  ({args.requests / ms * 1e3:.0f} tok/s)")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _, step_id = bench(runner, args.requests, args.contexts[-1], args.steps, step_id)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
    if args.ab_float32_rows:
        step_id = ab_float32_rows(runner, args.requests, args.contexts[-1], args.steps, args.ab_float32_rows, step_id)
    if args.prefill_requests:
        _, step_id = bench_prefill(runner, args.prefill_requests, args.prompt_len, step_id)  # first one pays allocations
        ms, step_id = bench_prefill(runner, args.prefill_requests, args.prompt_len, step_id)
        num_tokens = args.prefill_requests * args.prompt_len
        print(f"prefill step of {args.prefill_requests} x {args.prompt_len} tokens: {ms:.0f} ms  ({num_tokens / ms * 1e3:.0f} tok/s)")


if __name__ == "__main__":
    main()
