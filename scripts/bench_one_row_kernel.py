"""One sequence's decode on a GGUF file's blocks under each one-row kernel, alternated round after round in one
process (a shared machine slows both alike): the inter-token latency of the in-process engine (33 tokens after a
128-token prompt minus a 1-token run of the same prompt, its prefill cached) with the K-quants on the AVX2 vector
kernel and on the AVX2 GEMM (worker/csrc/ggml_blocks_avx2_gemm.cpp, which auto takes from AVX2_GEMM_MIN_ROWS rows on a
CPU without AVX-512 VNNI). How AVX2_GEMM_MIN_ROWS = 1 was chosen (docs/benchmarks.md).

Usage: OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_one_row_kernel.py FILE.gguf [ROUNDS]
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])

from core.sampling import SamplingParams  # noqa: E402
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig  # noqa: E402
from worker.linears.ggml_blocks import KERNEL_PATHS, GGMLBlocksLinear, auto_path  # noqa: E402

PROMPT = list(range(100, 228))
# both forced (auto is the GEMM on such a CPU since); a decode step's linears all run one row
VARIANTS = {"AVX2 vector kernel": KERNEL_PATHS["avx2"], "AVX2 GEMM": KERNEL_PATHS["avx2_gemm"]}


def main() -> None:
    path, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5
    llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, model=path, dtype="float32")), progress=False)

    def seconds(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate_token_ids([PROMPT], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start

    seconds(2)  # the prompt's pages cached, the kernels warm
    itl_ms: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, kernel_path in VARIANTS.items():
            GGMLBlocksLinear.kernel_path = kernel_path  # the class default every instance reads
            one = seconds(1)
            itl_ms[name].append((seconds(33) - one) / 32 * 1e3)
    paths = ", ".join(f"{name}={number}" for name, number in KERNEL_PATHS.items())
    print(f"{path}: auto's instruction set here: path {auto_path()} ({paths})")
    for name, values in itl_ms.items():
        print(f"{name:>18}: ITL ms {' '.join(f'{v:.1f}' for v in values)}; median {statistics.median(values):.1f}, "
              f"best {min(values):.1f}")


if __name__ == "__main__":
    main()
