"""A GGUF MoE file's decode steps with its MoE layers through one native call (GGMLBlocksExperts.routed) and through
run_grouped's torch calls around the two expert calls, alternated in one process:
`OMP_WAIT_POLICY=PASSIVE python scripts/bench_moe_routed.py .peers/shapes/qwen3-30b-a3b.Q4_K_M.gguf [repeats]`.

Each run: a 16-token prompt, then 25 greedy tokens; the one-token run is subtracted, so the figure is decode steps
only (ms a token)."""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from core.sampling import SamplingParams  # noqa: E402
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig  # noqa: E402
from worker.linears.ggml_experts import GGMLBlocksExperts  # noqa: E402


def main() -> None:
    path, repeats = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4
    started = time.time()
    llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, model=path, kv_cache_mb=256)), progress=False)
    print(f"loaded in {time.time() - started:.0f} s", flush=True)
    routed = GGMLBlocksExperts.routed
    prompt = [(7 * i + 11) % 30000 + 100 for i in range(16)]

    def seconds(tokens: int) -> float:
        began = time.perf_counter()
        llm.generate_token_ids([prompt], SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - began

    seconds(4)  # warm-up
    figures: dict[str, list[float]] = {"one native call": [], "torch calls": []}
    for repeat in range(repeats):
        for name in list(figures)[:: 1 if repeat % 2 == 0 else -1]:
            GGMLBlocksExperts.routed = routed if name == "one native call" else None  # None: run_grouped's own calls
            one, many = seconds(1), seconds(25)
            figures[name].append((many - one) / 24 * 1000)
    GGMLBlocksExperts.routed = routed
    for name, values in figures.items():
        print(f"{name}: median {statistics.median(values):.1f} ms a token ({', '.join(f'{v:.1f}' for v in values)})")


if __name__ == "__main__":
    main()
