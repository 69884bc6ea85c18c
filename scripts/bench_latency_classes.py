"""Latency targets per API key on the in-process engine: a closed loop where half the clients send with a
key whose class of service is a tight ITL target (the scheduler Request's target_itl_ms, which the
gateway sets from the key) and half with a key that has none, beside the same loop with no target at all.

    .venv/bin/python scripts/bench_latency_classes.py --target-itl-ms 500 --concurrency 8,32 --num-requests 64

Prints, per run and level: output tok/s and the inter-token P50/P99 of each class (ms), measured at the
engine (the time each step's tokens came out; no gRPC, gateway or client in between). A command, not a
test: figures depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import replace

from core.sampling import SamplingParams
from scheduler.request import Request
from tokenmill.bench.workload import add_workload_arguments
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig


def percentile(values: list[float], q: float) -> float | None:
    """Linear between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def closed_loop(llm: LLM, workload: list[tuple[list[int], int]], concurrency: int,
                tight_target_ms: float | None) -> dict:
    """concurrency clients; client i sends with the tight key when i is odd (if tight_target_ms is set).
    Returns tok/s and the inter-token gaps (s) of each class."""
    engine = llm.engine
    queue = list(workload)
    key_of: dict[str, str] = {}
    last_token_at: dict[str, float] = {}
    gaps: dict[str, list[float]] = {"tight": [], "none": []}
    ids = iter(range(10**9))

    def send(client: int) -> None:
        prompt, max_tokens = queue.pop(0)
        key = "tight" if tight_target_ms is not None and client % 2 else "none"
        request_id = f"c{client}-{next(ids)}"
        key_of[request_id] = key
        engine.add_request(Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                      ignore_eos=True),
                                   target_itl_ms=tight_target_ms if key == "tight" else None))

    for client in range(min(concurrency, len(queue))):
        send(client)
    start, num_tokens, misses_before = time.perf_counter(), 0, engine.scheduler.latency.num_itl_target_misses
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            num_tokens += len(output.new_token_ids)
            if output.new_token_ids and output.request_id in last_token_at:
                gaps[key_of[output.request_id]].append(now - last_token_at[output.request_id])
            last_token_at[output.request_id] = now
            if output.finished and queue:
                send(int(output.request_id[1:].split("-")[0]))
    return {"tok_s": num_tokens / (time.perf_counter() - start), "gaps": gaps,
            "misses": engine.scheduler.latency.num_itl_target_misses - misses_before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-itl-ms", type=float, required=True, help="the tight key's ITL target")
    parser.add_argument("--concurrency", default="8,32")
    add_workload_arguments(parser, num_requests=64, prompt_len=64, min_output=16, max_output=32)
    parser.add_argument("--num-blocks", type=int, default=1024)
    args = parser.parse_args()

    llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, num_blocks=args.num_blocks)), progress=False)
    rng = random.Random(0)
    workload = [([rng.randrange(100, 20000) for _ in range(args.prompt_len)], rng.randint(args.min_output, args.max_output))
                for _ in range(args.num_requests)]
    print(f"{args.num_requests} requests per level, {args.prompt_len}-token prompts, outputs "
          f"{args.min_output}-{args.max_output}; ITL in ms at the engine")
    print(f"{'run':<28}{'conc':>5}{'tok/s':>8}{'tight P50/P99':>16}{'none P50/P99':>15}{'misses':>8}")
    for name, target in (("no targets", None), (f"half the keys itl<={args.target_itl_ms:g}ms", args.target_itl_ms)):
        for concurrency in [int(c) for c in args.concurrency.split(",")]:
            llm.engine = llm.new_engine(replace(llm.config))  # a fresh scheduler: its model learns anew
            closed_loop(llm, workload[:4], 2, target)  # warm-up, not timed: the step-time model's first fit
            level = closed_loop(llm, workload, concurrency, target)

            def cell(key: str) -> str:
                p50, p99 = percentile(level["gaps"][key], 50), percentile(level["gaps"][key], 99)
                return "-" if p50 is None else f"{p50 * 1e3:.0f}/{p99 * 1e3:.0f}"
            print(f"{name:<28}{concurrency:>5}{level['tok_s']:>8.1f}{cell('tight'):>16}{cell('none'):>15}"
                  f"{level['misses']:>8}", flush=True)


if __name__ == "__main__":
    main()
