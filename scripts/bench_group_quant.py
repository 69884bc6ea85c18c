"""Per-linear timings of the group-quantized CPU op against float32 (oneDNN-packed) on the default
model's shapes, to choose GEMM_ROWS (worker/linears/group_quant.py). Variants are interleaved and the minimum of
several repeats is kept, so a busy machine distorts the ratios less than the absolute figures.
Columns: f32, the float kernel ("op"), the strips + GEMM, and the integer-dot kernel of --cpu-int8-activations;
then bfloat16: a bfloat16 weight through F.linear (what a bfloat16 checkpoint runs), the row op on bfloat16 x
(its avx512_bf16 kernel where the CPU has one), the bfloat16 strips, and one oneDNN call on a reordered
bfloat16 copy (worker.linears.dense_weights).
Usage: .venv/bin/python scripts/bench_group_quant.py [--rows 1,2,4,8,16,32,64]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.linears.dense_linear import dense_linear  # noqa: E402
from worker.linears.group_quant import quantize_weight  # noqa: E402
from worker.native_ops import cpu_ops_available  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def timed(fn, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--strip-rows", type=int, default=128)
    parser.add_argument("--shapes", default=",".join(SHAPES), help="which of the default model's linears")
    args = parser.parse_args()
    if not cpu_ops_available():
        print("compiled CPU ops unavailable: run scripts/build_cpu_ops.py first")
        return 1
    ops = torch.ops.tokenmill
    print(f"threads {torch.get_num_threads()}; microseconds per call, min of {args.repeats} repeats")
    print(f"{'linear':8} {'rows':>4} {'f32':>8} {'q4 op':>8} {'q4 strips':>11} {'q4 int8':>8} {'q8 op':>8} "
          f"{'q8 strips':>11} {'q8 int8':>8} {'bf16':>8} {'q4 op bf16':>11} {'q8 op bf16':>11} {'q4 strips bf16':>15} "
          f"{'dense bf16':>11}")
    torch.manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        weight = torch.randn(n, k)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        weight_bf16 = weight.bfloat16()
        dense_bf16 = torch.ops.mkldnn._reorder_linear_weight(weight_bf16, None)  # worker.linears.dense_weights' copy
        q4, q8 = quantize_weight(weight, 4), quantize_weight(weight, 8)
        calls = 3 if n > 10000 else 30
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            x_bf16 = x.bfloat16()
            variants = {
                "f32": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                **{f"{tag} op": (lambda q=q: ops.group_quant_linear(x, q.codes, q.scales, q.mins, q.bits, q.group_size))
                   for tag, q in (("q4", q4), ("q8", q8))},
                **{f"{tag} deq": (lambda q=q: ops.group_quant_linear_strips(
                    x, q.codes, q.scales, q.mins, q.bits, q.group_size, args.strip_rows))
                   for tag, q in (("q4", q4), ("q8", q8))},
                "bf16": lambda: torch.nn.functional.linear(x_bf16, weight_bf16),
                "dense bf16": lambda: dense_linear(x_bf16, dense_bf16),
                **{f"{tag} op bf16": (lambda q=q: ops.group_quant_linear(x_bf16, q.codes, q.scales, q.mins, q.bits,
                                                                         q.group_size))
                   for tag, q in (("q4", q4), ("q8", q8))},
                "q4 deq bf16": lambda: ops.group_quant_linear_strips(
                    x_bf16, q4.codes, q4.scales, q4.mins, q4.bits, q4.group_size, args.strip_rows),
                **{f"{tag} int8": (lambda q=q: ops.group_quant_linear_int8_dot(
                    x, q.codes, q.scales, q.mins, q.bits, q.group_size)) for tag, q in (("q4", q4), ("q8", q8))},
            }
            best = {key: float("inf") for key in variants}
            for fn in variants.values():
                fn()
            for _ in range(args.repeats):
                for key, fn in variants.items():
                    best[key] = min(best[key], timed(fn, calls))
            print(f"{name:8} {rows:4d} {best['f32']:8.0f} {best['q4 op']:8.0f} {best['q4 deq']:11.0f} "
                  f"{best['q4 int8']:8.0f} {best['q8 op']:8.0f} {best['q8 deq']:11.0f} {best['q8 int8']:8.0f} "
                  f"{best['bf16']:8.0f} {best['q4 op bf16']:11.0f} {best['q8 op bf16']:11.0f} {best['q4 deq bf16']:15.0f} "
                  f"{best['dense bf16']:11.0f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
