"""What --deterministic costs: the in-process engine on the default model, with and without the mode.

Three engines in one process, each on its own copy of the model: the default kernels, --deterministic
(dense copies in fixed tiles where --cpu-dense-weights keeps them), and --deterministic with
--cpu-dense-weights off (the row kernel for every row). They take turns, ROUNDS times, so a machine
whose load drifts slows them alike; the medians are printed. Per round and engine:

- sync: one request (128-token prompt, 64 output tokens) alone: output tokens/s;
- 16 decode: 16 requests at once with 8-token prompts, 64 output tokens each: output tokens/s;
- 16 prefill+decode: 16 requests at once with 128-token prompts, 64 output tokens each: output tokens/s.

Greedy, EOS ignored, a warm-up request per engine outside the timings. Also prints whether each engine's
sync outputs equal the same requests' in its 16-request run (the mode's claim: always).

    .venv/bin/python scripts/bench_deterministic.py [--rounds 3] [--no-cpu-fused-ops] [--dtype auto]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.sampling import SamplingParams  # noqa: E402
from scheduler.options import SchedulerOptions  # noqa: E402
from tokenmill.llm import LLM, EngineConfig  # noqa: E402
from worker.options import WorkerOptions  # noqa: E402
from worker.build import build_runner  # noqa: E402

NUM_STREAMS, PROMPT_LEN, SHORT_PROMPT_LEN, OUTPUT_LEN = 16, 128, 8, 64
VARIANTS = {"default": dict(deterministic=False), "deterministic": dict(deterministic=True),
            "deterministic, dense weights off": dict(deterministic=True, cpu_dense_weights="off")}


def engine(args, **options) -> LLM:
    execution = WorkerOptions(model=args.model, dtype=args.dtype, block_size=16, kv_cache_mb=256, device="cpu",
                              cpu_fused_ops=not args.no_cpu_fused_ops, quantization=args.quantization, **options)
    runner = build_runner(execution, progress=False)
    return LLM(EngineConfig(worker=execution, scheduler=SchedulerOptions(max_num_seqs=64, max_num_batched_tokens=512)),
               runner=runner, progress=False)


def timed(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate_token_ids(prompts, params)
    return len(prompts) * OUTPUT_LEN / (time.perf_counter() - start), outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-cpu-fused-ops", action="store_true", help="the plain-torch reference path")
    args = parser.parse_args()
    engines = {name: engine(args, **options) for name, options in VARIANTS.items()}
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 20000) for _ in range(PROMPT_LEN)] for _ in range(NUM_STREAMS + 1)]
    figures = {name: {"sync": [], "16 decode": [], "16 prefill+decode": []} for name in engines}
    equal = {name: True for name in engines}
    for llm in engines.values():
        timed(llm, [prompts[-1]])  # warm-up
    for round_index in range(args.rounds):
        for name, llm in engines.items():
            rate, alone = timed(llm, [prompts[round_index % NUM_STREAMS]])
            figures[name]["sync"].append(rate)
            figures[name]["16 decode"].append(timed(llm, [p[:SHORT_PROMPT_LEN] for p in prompts[:NUM_STREAMS]])[0])
            rate, batched = timed(llm, prompts[:NUM_STREAMS])
            figures[name]["16 prefill+decode"].append(rate)
            equal[name] &= alone[0] == batched[round_index % NUM_STREAMS]
        print(json.dumps({name: {k: round(v[-1], 1) for k, v in f.items()} for name, f in figures.items()}), flush=True)
    base = {k: statistics.median(v) for k, v in figures["default"].items()}
    for name, result in figures.items():
        medians = {k: statistics.median(v) for k, v in result.items()}
        print(f"{name:34s} " + "  ".join(f"{k} {v:6.1f} tok/s ({v / base[k]:.2f}x)" for k, v in medians.items())
              + f"  sync == batched: {equal[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
