"""One sequence's decode on a GGUF file's blocks under each one-row kernel, alternated round after round in one
process (a shared machine slows both alike): the inter-token latency of the in-process engine (33 tokens after a
128-token prompt minus a 1-token run of the same prompt, its prefill cached) with the K-quants on the AVX2 vector
kernel, on the AVX2 GEMM over the file's blocks (worker/csrc/ggml_blocks_avx2_gemm.cpp, which auto takes from
AVX2_GEMM_MIN_ROWS rows on a CPU without AVX-512 VNNI), and on the same GEMM over the blocks repacked at load
(worker/csrc/ggml_blocks_repack.cpp: what auto runs on such a CPU since). How AVX2_GEMM_MIN_ROWS = 1 and the repack
were chosen (docs/benchmarks.md). The model loads in the file's layout; the repacked linears are built beside them
(twice the weight memory, a benchmark's only) and swapped in for their rounds.

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
from worker.linears.ggml_repack import repackable, repacked_weight  # noqa: E402

PROMPT = list(range(100, 228))
# each forced (auto is the repacked GEMM on such a CPU since), and whether it runs the repacked linears; a decode
# step's linears all run one row
VARIANTS = {"AVX2 vector kernel": (KERNEL_PATHS["avx2"], False), "AVX2 GEMM": (KERNEL_PATHS["avx2_gemm"], False),
            "AVX2 GEMM, repacked": (KERNEL_PATHS["avx2_gemm"], True)}


def main() -> None:
    path, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5
    llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, model=path, dtype="float32", cpu_block_repack=False)),
              progress=False)
    swaps = [(parent, name, child, GGMLBlocksLinear(repacked_weight(child.weight_blocks), child.bias))
             for parent in list(llm.runner.model.modules()) for name, child in parent.named_children()
             if isinstance(child, GGMLBlocksLinear) and repackable(child.weight_blocks)]

    def seconds(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate_token_ids([PROMPT], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start

    seconds(2)  # the prompt's pages cached, the kernels warm
    itl_ms: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, (kernel_path, repacked) in VARIANTS.items():
            GGMLBlocksLinear.kernel_path = kernel_path  # the class default every instance reads
            for parent, child_name, plain, packed in swaps:
                setattr(parent, child_name, packed if repacked else plain)
            one = seconds(1)
            itl_ms[name].append((seconds(33) - one) / 32 * 1e3)
    paths = ", ".join(f"{name}={number}" for name, number in KERNEL_PATHS.items())
    print(f"{path}: auto's instruction set here: path {auto_path()} ({paths}); {len(swaps)} linears repacked")
    for name, values in itl_ms.items():
        print(f"{name:>18}: ITL ms {' '.join(f'{v:.1f}' for v in values)}; median {statistics.median(values):.1f}, "
              f"best {min(values):.1f}")


if __name__ == "__main__":
    main()
