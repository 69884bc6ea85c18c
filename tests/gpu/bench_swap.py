"""Memory-pressure benchmark (issue 19): a KV cache too small for the running set, with preemption by
swap to the host tier (pinned pages, copy stream), by recompute, and the static policy, side by side:
`python -m tests.gpu.bench_swap`. In-process: the real Scheduler and ModelRunner on a random-weight
model (Llama-3-8B layer shapes, fewer layers), so a step costs what it costs in the worker, minus RPC.
"swap" lets the scheduler choose swap or recompute per victim by cost, "swap-always" swaps every victim
(the copies' own cost). Per mode it prints wall time, output tokens/s, the P50/P99 step time (what a decoding request waits
between tokens), preemptions and how many were swaps. --dry-run: a tiny model on the CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time

import torch

from core.sampling import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.engine import EngineCore
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.gpu.random_model import llama3_8b_config, random_llama, tiny_config
from worker.model.kv_cache import bytes_per_block
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions

# mode: (kv_policy, host tier, always swap). "swap" chooses per victim by cost, which on a fast GPU can be
# recompute every time (the first H200 run: 23 preemptions, 0 swapped); "swap-always" measures the copies.
MODES = {"swap": ("paged", True, False), "swap-always": ("paged", True, True), "recompute": ("paged", False, False),
         "static": ("static", False, False)}


def run_mode(model, config, args, device, kv_policy: str, swap: bool, always_swap: bool, dtype) -> dict:
    page_bytes = bytes_per_block(config, dtype, args.block_size)
    num_host_blocks = args.num_host_blocks if swap else 0
    runner = ModelRunner(model, config, num_blocks=args.num_blocks, block_size=args.block_size, dtype=dtype,
                         options=WorkerOptions(kernel_backend=args.kernel_backend), num_host_blocks=num_host_blocks)
    runner.warm_up()
    scheduler = Scheduler(SchedulerConfig(
        num_blocks=args.num_blocks, block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=config.max_position_embeddings, kv_policy=kv_policy, num_host_blocks=num_host_blocks,
        bytes_per_block=page_bytes, **({"swap_bytes_per_s": float("inf")} if always_swap else {})))
    engine = EngineCore(scheduler, runner)
    rng = random.Random(0)
    for index in range(args.num_requests):
        prompt = [rng.randrange(3, config.vocab_size) for _ in range(args.prompt_len)]
        engine.add_request(Request(f"r{index}", prompt, SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=rng.randint(args.max_output // 2, args.max_output))))
    step_s, num_tokens = [], 0
    started = time.perf_counter()
    while engine.has_unfinished():
        step_started = time.perf_counter()
        outputs = engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_s.append(time.perf_counter() - step_started)
        num_tokens += sum(len(output.new_token_ids) for output in outputs)
    wall = time.perf_counter() - started
    step_s.sort()
    return {"wall_s": wall, "tokens_per_s": num_tokens / wall, "step_p50_ms": statistics.median(step_s) * 1e3,
            "step_p99_ms": step_s[min(len(step_s) - 1, int(0.99 * len(step_s)))] * 1e3,
            "preemptions": scheduler.num_preemptions, "swapped": scheduler.num_swapped_preemptions}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.bench_swap", description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, a few requests")
    parser.add_argument("--num-layers", type=int, default=8, help="Llama-3-8B layers kept (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=768, help="device pages: ~16 of the 64 requests fit")
    parser.add_argument("--num-host-blocks", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kernel-backend", default="auto", choices=("auto", "torch", "triton"))
    parser.add_argument("--rounds", type=int, default=2,
                        help="every mode this many times, reporting the last round: the first mode of the first "
                             "round also pays for compiling the kernels' prompt-length variants (default: %(default)s)")
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.dry_run:
        device, dtype, config = torch.device("cpu"), torch.float32, tiny_config(num_layers=2)
        args.num_requests, args.prompt_len, args.max_output, args.num_blocks = 6, 12, 8, 12
        args.num_host_blocks, args.block_size, args.max_num_batched_tokens = 64, 4, 32
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        config = dataclasses.replace(llama3_8b_config(), num_layers=args.num_layers)
    model = random_llama(config, dtype, device, seed=1)
    results, rounds = {}, []
    for round_index in range(args.rounds):
        results = {}
        for mode, (kv_policy, swap, always_swap) in MODES.items():
            results[mode] = row = run_mode(model, config, args, device, kv_policy, swap, always_swap, dtype)
            print(f"round {round_index + 1} {mode:11s} wall {row['wall_s']:7.2f} s  {row['tokens_per_s']:8.1f} tok/s  "
                  f"step P50/P99 {row['step_p50_ms']:7.1f}/{row['step_p99_ms']:7.1f} ms  preemptions {row['preemptions']} "
                  f"(swapped {row['swapped']})", flush=True)
        rounds.append(results)
    if args.output:
        with open(args.output, "w") as file:
            json.dump({"args": vars(args), "results": results, "rounds": rounds}, file, indent=2)
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
