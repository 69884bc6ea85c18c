"""One Qwen3-30B-A3B-shaped MoE layer in bfloat16 on the GPU: `python -m tests.gpu.bench_fused_moe` (issue 36 item 5).

128 experts, top 8, hidden 2048, expert width 768. Per token count: the fused-MoE kernel (worker.kernels.fused_moe:
align in torch, two grouped-GEMM launches, SiLU·mul, the k outputs summed), timed as replays of a CUDA graph (as the
Triton path's decode steps run it; this also shows the layer captures, no host sync inside), against the torch
path's grouped experts (worker.model.moe.run_experts: one cuBLAS gate/up and down per expert with tokens, a host
sync for the counts, so eager launches). Each timed output is first checked against the float32 reference.
Columns: microseconds, and the fused kernel's GB/s over the expert weights it must read (every expert some token
chose, each once) — at one token, the bound that matters. --dry-run: a tiny layer on the CPU under the Triton
interpreter, untimed, so the script cannot rot where there is no GPU (tests/gpu/test_bench_smoke.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768
TINY = (8, 2, 64, 32)  # --dry-run's (experts, top_k, hidden, inter)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.bench_fused_moe", description=__doc__)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--tokens", default="1,16,64,256")
    parser.add_argument("--output", help="write the results as JSON here")
    return parser.parse_args(argv)


def time_us(fn, graph: bool, device: torch.device) -> float:
    if device.type != "cuda":
        fn()
        return float("nan")
    import triton.testing

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, rep=40, return_mode="median") * 1e3


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    from worker.kernels.fused_moe import fused_moe
    from worker.model.moe import route, run_experts

    device = torch.device("cpu" if args.dry_run else "cuda")
    experts, top_k, hidden, inter = TINY if args.dry_run else (EXPERTS, TOP_K, HIDDEN, INTER)
    generator = torch.Generator(device=device).manual_seed(0)

    def draw(*shape: int, fan_in: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=generator) * fan_in**-0.5

    gate_up = draw(experts, 2 * inter, hidden, fan_in=hidden).bfloat16()
    down = draw(experts, hidden, inter, fan_in=inter).bfloat16()
    router = draw(experts, hidden, fan_in=hidden)
    expert_bytes = (2 * inter * hidden + hidden * inter) * 2  # one expert's bfloat16 weights
    # three bfloat16 roundings are ~5e-3 of the output; a wrong expert or pair is O(1). The interpreter rounds
    # float32 to bfloat16 toward zero (twice the error of the GPU's round-to-nearest): ~1.3e-2 there
    max_error = 3e-2 if args.dry_run else 1e-2
    rows = []
    for num_tokens in [int(t) for t in args.tokens.split(",")][: 2 if args.dry_run else None]:
        x = torch.randn(num_tokens, hidden, device=device, generator=generator)
        weights, chosen = route(x, router, top_k, norm_topk_prob=True, weights_float=True)
        x = x.bfloat16()
        expected = run_experts(x.float(), weights, chosen, gate_up.float(), down.float())
        checks = {}
        for name, call in (("fused", lambda: fused_moe(x, weights, chosen, gate_up, down)),
                           ("torch", lambda: run_experts(x, weights, chosen, gate_up, down))):
            error = ((call().float() - expected).norm() / expected.norm()).item()
            if not error < max_error:
                raise AssertionError(f"{name} at {num_tokens} tokens: relative error {error:.3g}")
            checks[name] = error
        fused_us = time_us(lambda: fused_moe(x, weights, chosen, gate_up, down), True, device)
        torch_us = time_us(lambda: run_experts(x, weights, chosen, gate_up, down), False, device)
        weight_bytes = int(torch.unique(chosen).numel()) * expert_bytes
        rows.append(dict(tokens=num_tokens, experts_read=int(torch.unique(chosen).numel()), fused_us=fused_us,
                         torch_us=torch_us, fused_weight_gb_s=weight_bytes / fused_us / 1e3,
                         fused_error=checks["fused"], torch_error=checks["torch"]))
        row = rows[-1]
        print(f"{num_tokens:5d} tokens, {row['experts_read']:3d} experts: fused {fused_us:9.1f} us "
              f"({row['fused_weight_gb_s']:7.1f} GB/s of weights), torch grouped {torch_us:9.1f} us, "
              f"rel. error {row['fused_error']:.1e} / {row['torch_error']:.1e}", flush=True)
    result = dict(shape=dict(experts=experts, top_k=top_k, hidden=hidden, inter=inter, dtype="bfloat16"), rows=rows,
                  gpu=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter, untimed)")
    print("fused moe:", json.dumps(result))
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(result, handle, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
