"""Decode speed of the in-process engine per weight path, one run: ms per token for one sequence and
tok/s for 32 (64 output tokens after a 128-token prompt, greedy, EOS ignored). Paths: none (float32
reference), auto (the GGUF's formats as stored), auto+int8act (plus --cpu-int8-activations), and the same
two with bfloat16 activations (auto-bf16, auto-bf16+int8act).
Usage: OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_decode_cpu.py [none auto auto+int8act]
"""
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])

from core.sampling import SamplingParams  # noqa: E402
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig  # noqa: E402

VARIANTS = {"none": dict(quantization="none"), "auto": dict(quantization="auto"),
            "auto+int8act": dict(quantization="auto", cpu_int8_activations=True),
            "auto-bf16": dict(quantization="auto", dtype="bfloat16"),
            "auto-bf16+int8act": dict(quantization="auto", dtype="bfloat16", cpu_int8_activations=True)}


def main(names: list[str]) -> int:
    prompt = list(range(100, 228))
    print("threads", torch.get_num_threads())
    for name in names or list(VARIANTS):
        llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, kv_cache_mb=256, **VARIANTS[name])))
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        llm.generate_token_ids([prompt], params)  # warm-up
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            out = llm.generate_token_ids([prompt], params)[0]
            best = min(best, time.perf_counter() - started)
        prompts = [[(p * 7 + i) % 20000 + 100 for p in prompt] for i in range(32)]
        started = time.perf_counter()
        llm.generate_token_ids(prompts, params)
        elapsed = time.perf_counter() - started
        print(f"{name}: 1 seq {best / 64 * 1e3:.1f} ms/token (incl. its prefill); 32 seqs: {32 * 64 / elapsed:.0f} tok/s; "
              f"first tokens {out[:6]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
