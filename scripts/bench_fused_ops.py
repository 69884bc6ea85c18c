"""The compiled decoder ops (worker.paths.fused_ops) against the plain-torch reference, in one process: two
in-process engines on the default model, fused on and off, min of 3 runs each, 48 greedy tokens after a
128-token prompt, for each batch size; prints tok/s, the ratio and whether the outputs are identical.
Usage: OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_fused_ops.py [auto|none] [1,32]
"""
import sys
import time
from dataclasses import replace

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])

from core.sampling import SamplingParams  # noqa: E402
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig  # noqa: E402


def main(argv: list[str]) -> int:
    quantization = argv[0] if argv else "auto"
    batch_sizes = [int(n) for n in argv[1].split(",")] if len(argv) > 1 else [1, 32]
    engines = {fused: LLM(EngineConfig(worker=replace(ENGINE_WORKER, kv_cache_mb=256, quantization=quantization,
                                                      cpu_fused_ops=fused)))
               for fused in (False, True)}
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    for n in batch_sizes:
        prompts = [[(p * 7 + i) % 20000 + 100 for p in range(100, 228)] for i in range(n)]
        outputs = {fused: llm.generate_token_ids(prompts, params) for fused, llm in engines.items()}  # warm-up
        best = {fused: float("inf") for fused in engines}
        for _ in range(3):  # interleaved, so both see the same machine
            for fused, llm in engines.items():
                started = time.perf_counter()
                llm.generate_token_ids(prompts, params)
                best[fused] = min(best[fused], time.perf_counter() - started)
        same = sum(a == b for a, b in zip(outputs[False], outputs[True]))
        print(f"{quantization} n={n}: plain torch {n * 48 / best[False]:.1f} tok/s, fused {n * 48 / best[True]:.1f} "
              f"tok/s, ratio {best[False] / best[True]:.2f}x; identical outputs {same}/{n}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
