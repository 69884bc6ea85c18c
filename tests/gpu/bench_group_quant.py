"""Group-quantized weight-only matmul on the GPU, on Llama-3-8B's linear shapes: `python -m tests.gpu.bench_group_quant`.

Per shape, layout and row count: the tiled kernel (the only one before the GEMV kernel), the GEMV kernel
(at most GEMV_MAX_ROWS rows), the dequantizing kernel (kernel="dequant": the weight tile in bfloat16, one
deep dot a K step) and bfloat16 weights through torch (cuBLAS), as microseconds and achieved GB/s (codes,
scales, mins, x and out, each once). First it sweeps the GEMV kernel's (BLOCK_N, BLOCK_GROUPS, num_warps)
at one row, 4-bit groups of 32, over every shape, and ranks the configurations by their summed time; the
best is the one every later row uses, and the last line printed is `best gemv config: N,G,W`
(tests/gpu/run.sh hands it to bench_decode). Then it sweeps the dequantizing kernel's (BLOCK_N,
BLOCK_GROUPS, num_warps) likewise at 32 rows; the best one is the dequant column's. Every timed output is
first checked against the float32 reference. Times are medians of CUDA-graph replays. --dry-run: a tiny shape on the CPU under the Triton interpreter, one configuration.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

SHAPES = {  # name: (in_features K, out_features N), Llama-3-8B
    "wqkv": (4096, 6144), "wo": (4096, 4096), "w_gate_up": (4096, 28672), "w_down": (14336, 4096),
    "lm_head": (4096, 128256)}
SWEEP = list(itertools.product((16, 32, 64), (4, 8, 16), (2, 4, 8)))  # (BLOCK_N, BLOCK_GROUPS, num_warps)
DEQUANT_SWEEP = list(itertools.product((64, 128), (2, 4, 8), (4, 8)))  # the same for kernel="dequant"
DEQUANT_SWEEP_ROWS = 32


def time_us(fn, device: torch.device) -> float:
    if device.type != "cuda":
        fn()
        return float("nan")
    import triton.testing

    # replayed from a CUDA graph, as the runner's decode steps are: eager launches cost more host time
    # (argument checks, the launcher) than a one-row GEMV takes on the device
    return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3


def make_weight(k: int, n: int, bits: int, group_size: int, device: torch.device, seed: int):
    from worker.linears.group_quant import quantize_weight

    generator = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(n, k, device=device, generator=generator) * 0.02
    return quantize_weight(weight, bits, group_size)


def bytes_moved(weight, rows: int, k: int, n: int) -> int:
    return (weight.codes.numel() + 4 * weight.scales.numel() + 4 * weight.mins.numel()) + 2 * rows * (k + n)


def check(out: torch.Tensor, reference: torch.Tensor, what: str) -> float:
    error = ((out.float() - reference).norm() / reference.norm()).item()
    if not error < 1e-2:  # bfloat16 output rounding is ~4e-3 relative; a wrong nibble or min is O(1)
        raise AssertionError(f"{what}: relative error {error:.3g} against the float32 reference")
    return error


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu.bench_group_quant", description=__doc__)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--rows", default="1,4,8,16,32,64")
    parser.add_argument("--gemv-sweep", action=argparse.BooleanOptionalAction, default=True,
                        help="sweep the GEMV configurations (--no-gemv-sweep: GEMV_CONFIG only)")
    parser.add_argument("--output", help="write the results as JSON here")
    return parser.parse_args(argv)


def sweep(label: str, configs, per_shape_of, at: str = "") -> list[dict]:
    """Each configuration's time per shape (per_shape_of(config) -> {shape: us}); one the compiler rejects
    (registers, shared memory) is skipped with its reason."""
    measured = []
    for config in configs:
        try:
            per_shape = per_shape_of(config)
        except Exception as error:  # noqa: BLE001 - a rejected configuration is skipped, the rest go on
            print(f"{label} {config}: skipped, {type(error).__name__}: {str(error)[:160]}", flush=True)
            continue
        total = sum(per_shape.values())
        measured.append({"config": list(config), "total_us": total, "us": per_shape})
        print(f"{label} {config}{at}: " + " ".join(f"{name} {us:7.1f}" for name, us in per_shape.items())
              + f"  total {total:8.1f} us", flush=True)
    return measured


def table_row(name, k, n, bits, group, rows, weight, x, timed, best, best_dequant, device, gemv_max_rows) -> dict:
    """One shape x layout x row count: tiled vs GEMV (best config) vs dequantizing kernel vs bfloat16 weights."""
    tiled_us = timed(name, bits, group, rows, tiled=True)
    gemv_us = timed(name, bits, group, rows, best) if rows <= gemv_max_rows else float("nan")
    dequant_us = timed(name, bits, group, rows, dequant=best_dequant)
    dense = weight.dequantize().to(torch.bfloat16)
    dense_us = time_us(lambda: F.linear(x, dense), device)
    del dense
    fastest = min(us for us in (tiled_us, gemv_us, dequant_us) if not math.isnan(us)) if device.type == "cuda" \
        else float("nan")
    row = {"shape": name, "k": k, "n": n, "bits": bits, "group_size": group, "rows": rows, "tiled_us": tiled_us,
           "gemv_us": gemv_us, "dequant_us": dequant_us, "bf16_us": dense_us,
           "gb_s": bytes_moved(weight, rows, k, n) / fastest / 1e3}
    print(f"{name:>9} {bits}/{group:<5} {rows:>4} {tiled_us:>9.1f} {gemv_us:>8.1f} {dequant_us:>10.1f} "
          f"{dense_us:>8.1f} {row['gb_s']:>6.0f} {tiled_us / fastest:>10.2f} {dense_us / fastest:>9.2f}", flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from worker.kernels import group_quant_matmul as gq

    device = torch.device("cpu" if args.dry_run else "cuda")
    shapes = {"tiny": (96, 40)} if args.dry_run else SHAPES
    gemv_configs = [gq.GEMV_CONFIG] if args.dry_run or not args.gemv_sweep else SWEEP
    layouts = [(4, 32)] if args.dry_run else list(gq.LAYOUTS)
    row_counts = [1, 3] if args.dry_run else [int(r) for r in args.rows.split(",")]
    weights = {(name, bits, group): make_weight(k, n, bits, group, device, seed)
               for seed, (name, (k, n)) in enumerate(shapes.items()) for bits, group in layouts}
    inputs = {(name, rows): torch.randn(rows, k, device=device).to(torch.bfloat16)
              for name, (k, n) in shapes.items() for rows in row_counts}

    def timed(name, bits, group, rows, config=None, tiled=False, dequant=None):
        """dequant: (BLOCK_N, BLOCK_GROUPS, num_warps) of the dequantizing kernel, which runs instead."""
        weight, x = weights[name, bits, group], inputs[name, rows]
        reference = F.linear(x.float(), weight.dequantize())
        kernel = "dequant" if dequant else "tiled" if tiled else "auto"
        dequant_config = (gq._dequant_config(rows)[0], *dequant) if dequant else None

        def call():
            return gq.group_quant_matmul(x, weight.codes, weight.scales, weight.mins, bits, group, gemv_config=config,
                                         kernel=kernel, dequant_config=dequant_config)

        check(call(), reference, f"{name} {bits}-bit/{group} rows {rows} {kernel} {dequant or config}")
        return time_us(call, device)

    # 1. the GEMV sweep: one row, 4-bit groups of 32
    sweep_rows = sweep("gemv", gemv_configs, lambda config: {name: timed(name, 4, 32, 1, config) for name in shapes})
    ranked = sorted(sweep_rows, key=lambda row: row["total_us"]) if device.type == "cuda" else sweep_rows
    best = tuple(ranked[0]["config"]) if ranked else gq.GEMV_CONFIG

    # 1b. the dequantizing kernel's sweep at DEQUANT_SWEEP_ROWS rows (or the largest row count asked for)
    dequant_rows = DEQUANT_SWEEP_ROWS if DEQUANT_SWEEP_ROWS in row_counts else max(row_counts)
    dequant_sweep = [gq._dequant_config(dequant_rows)[1:]] if args.dry_run else DEQUANT_SWEEP
    dequant_ranked = sweep("dequant", dequant_sweep, lambda config: {
        name: timed(name, 4, 32, dequant_rows, dequant=config) for name in shapes}, at=f" at {dequant_rows} rows")
    if device.type == "cuda":
        dequant_ranked.sort(key=lambda row: row["total_us"])
    best_dequant = tuple(dequant_ranked[0]["config"]) if dequant_ranked else tuple(gq._dequant_config(dequant_rows)[1:])

    # 2. every layout and row count: tiled vs GEMV (best config) vs bfloat16 weights
    print(f"{'shape':>9} {'layout':>7} {'rows':>4} {'tiled us':>9} {'gemv us':>8} {'dequant us':>10} {'bf16 us':>8} "
          f"{'GB/s':>6} {'tiled/best':>10} {'bf16/best':>9}", flush=True)
    table = [table_row(name, k, n, bits, group, rows, weights[name, bits, group], inputs[name, rows], timed, best,
                       best_dequant, device, gq.GEMV_MAX_ROWS)
             for (name, (k, n)), (bits, group), rows in itertools.product(shapes.items(), layouts, row_counts)]
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "best_gemv_config": list(best), "sweep": ranked, "best_dequant_config": list(best_dequant),
               "dequant_sweep": dequant_ranked, "table": table}
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(results, handle, indent=2)
    print(f"best gemv config: {','.join(map(str, best))}", flush=True)
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
