"""The in-process engine (tokenmill.llm.LLM) on one GGUF file, per variant of worker options: load time, the
inter-token latency of one sequence (33 tokens after a 128-token prompt, minus a 1-token run of the same
prompt, so its prefill is left out), tok/s of N sequences at once (their prefill included), their decode step
alone (the same minus a 1-token run, prompts cached), and the resident set after them.

Usage: OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_engine_gguf.py FILE.gguf N [VARIANT ...]
  a VARIANT is comma-separated WorkerOptions fields: "" (the defaults), cpu_block_kernels=off (0 / 1 are
  booleans), cpu_dense_weights=on
"""
from __future__ import annotations

import sys
import time
from dataclasses import replace

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])

from core.sampling import SamplingParams  # noqa: E402
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig  # noqa: E402
from worker.memory import status_bytes  # noqa: E402

PROMPT = list(range(100, 228))


def options(variant: str) -> dict:
    fields = dict(item.split("=", 1) for item in variant.split(",") if item)
    return {name: value == "1" if value in ("0", "1") else value for name, value in fields.items()}


def best_of(runs: int, fn) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure(path: str, sequences: int, variant: str) -> str:
    started = time.perf_counter()
    llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, model=path, kv_cache_mb=512, **options(variant))))
    load = time.perf_counter() - started
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    many = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
    llm.generate_token_ids([PROMPT], many)  # warm-up (and the prompt in the prefix cache for both runs)
    first = best_of(2, lambda: llm.generate_token_ids([PROMPT], one))
    whole = best_of(2, lambda: llm.generate_token_ids([PROMPT], many))
    prompts = [[(token * 7 + i) % 20000 + 100 for token in PROMPT] for i in range(sequences)]
    elapsed = best_of(1, lambda: llm.generate_token_ids(prompts, many))
    # again, their prompts now in the prefix cache: the N-row decode step alone, as the single ITL above
    prefilled = best_of(2, lambda: llm.generate_token_ids(prompts, one))
    decoded = best_of(2, lambda: llm.generate_token_ids(prompts, many))
    step = (decoded - prefilled) / 32
    return (f"{variant or 'defaults'}: load {load:.0f} s, ITL {(whole - first) / 32 * 1e3:.1f} ms, {sequences} sequences "
            f"{sequences * 33 / elapsed:.1f} tok/s (prefill included), their decode step {step * 1e3:.1f} ms "
            f"({sequences / step:.1f} tok/s), RSS {status_bytes('VmRSS') / 2**20:.0f} MiB")


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    path, sequences = argv[0], int(argv[1])
    for variant in argv[2:] or [""]:
        print(measure(path, sequences, variant), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
