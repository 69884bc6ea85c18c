"""Step-time overhead of constrained decoding (issue 18): 32 running requests, half of them held to a
JSON schema, against the same 32 unconstrained, on the default model through the ModelRunner (the
worker's real step: forward, masks, sampling). Not a test: it prints figures.

    .venv/bin/python scripts/bench_constrained_step.py [--steps 40] [--threads N]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import runpy
import statistics
import time
from pathlib import Path

import torch

from core.sampling import ConstraintKind, OutputConstraint, SamplingParams
from core.step import CachedRequestData, NewRequestData, StepPlan
from worker.build import build_runner
from worker.options import WorkerOptions

# the order schema the engine choice was measured with
SCHEMA = runpy.run_path(str(Path(__file__).with_name("bench_grammar_engines.py")))["SCHEMA"]


def run(runner, num_requests: int, num_constrained: int, prompt_len: int, steps: int, tag: str) -> list[float]:
    block_size = runner.block_size
    blocks_per_request = -(-(prompt_len + steps + 1) // block_size)
    constraint = OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
    new = []
    for i in range(num_requests):
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0 if i % 2 else 1.0, seed=i, ignore_eos=True,
                                constraint=constraint if i < num_constrained else None)
        blocks = list(range(i * blocks_per_request, (i + 1) * blocks_per_request))
        new.append(NewRequestData(f"{tag}{i}", [(7 * i + j) % 1000 + 100 for j in range(prompt_len)], prompt_len,
                                  params, blocks, 0))
    runner.execute(StepPlan(0, new_requests=new, num_scheduled_tokens={r.request_id: prompt_len for r in new}))
    times = []
    for step in range(1, steps + 1):
        plan = StepPlan(step, cached_requests=[CachedRequestData(r.request_id, [], prompt_len + step - 1) for r in new],
                        num_scheduled_tokens={r.request_id: 1 for r in new})
        started = time.perf_counter()
        runner.execute(plan)
        times.append(time.perf_counter() - started)
    runner.execute(StepPlan(steps + 1, finished_request_ids=[r.request_id for r in new]))
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runner = build_runner(WorkerOptions(dtype="float32", block_size=16, num_blocks=32 * 8, device="cpu"), progress=False)
    runner.warm_up()
    print(f"torch threads {torch.get_num_threads()}; 32 running requests, prompt 32 tokens, {args.steps} decode steps")
    mask_times: list[float] = []
    bitmask = runner.structured_output.bitmask

    def timed_bitmask(*args, **kwargs):  # the masks' own share of a step, whatever the machine's load
        started = time.perf_counter()
        result = bitmask(*args, **kwargs)
        mask_times.append(time.perf_counter() - started)
        return result

    runner.structured_output.bitmask = timed_bitmask
    plain, constrained = [], []
    for round_index in range(args.rounds):  # interleaved, so drift in machine load hits both alike
        plain += run(runner, 32, 0, 32, args.steps, f"p{round_index}-")
        constrained += run(runner, 32, 16, 32, args.steps, f"c{round_index}-")
    for name, times in (("unconstrained", plain), ("16 of 32 constrained", constrained)):
        print(f"{name:22s} step median {statistics.median(times) * 1e3:7.2f} ms  mean {statistics.mean(times) * 1e3:7.2f} ms")
    overhead = statistics.median(constrained) / statistics.median(plain) - 1
    print(f"overhead (median step): {overhead * 100:+.1f}%")
    mask_median = statistics.median(mask_times)
    print(f"masks of the 16 constrained rows per step: median {mask_median * 1e3:.2f} ms, mean "
          f"{statistics.mean(mask_times) * 1e3:.2f} ms = {mask_median / statistics.median(plain) * 100:.2f}% "
          f"of the unconstrained median step")
    print(f"grammars compiled: {runner.structured_output.compiler.num_compiled}")


if __name__ == "__main__":
    main()
