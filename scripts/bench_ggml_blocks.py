"""GGML block linears (worker.linears.ggml_blocks) on a real model's shapes: microseconds per call of the
integer-dot vector kernel (forward_rows), the AMX-INT8 tiles, the AVX2 GEMM (worker/csrc/ggml_blocks_avx2_gemm.cpp,
forced: it runs on any x86-64 CPU with AVX2), the same GEMM on the weight repacked as the loader repacks it on an
AVX2-only CPU (worker/csrc/ggml_blocks_repack.cpp, forced likewise), forward_strips (on AMX-BF16 CPUs the
tiles of worker/csrc/ggml_blocks_amx_bf16.cpp), the dequantized strips through torch (forward_dequantized_strips)
and a dense bfloat16 GEMM on a weight kept dequantized (what --cpu-dense-weights would hold), at several row
counts, plus the GB/s the one-row kernel reads the weight at. Random blocks with sane scales (speed does not depend on values). The
variants are timed in turn, round after round (--repeat rounds, the best of each), so that a machine shared
with other work slows them alike; the last line also gives the GEMM's and the repacked GEMM's medians.
The Qwen2.5-1.5B Q4_K_M layer by default: qkv Q4_K+Q4_K+Q6_K, o Q4_K, gate_up Q4_K, down Q6_K.

Usage: .venv/bin/python scripts/bench_ggml_blocks.py [--rows 1,4,16,32,64,128] [--threads 2] [--repeat 20]
       [--hidden 1536 --intermediate 8960 --kv 256] [--cold 24]
--cold N: instead, the read rate on weights not in cache: N copies of each linear's weight (hundreds of MB)
called in turn, as a decode step reads a model's layers; one row of x, or the first of --rows.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])

from worker.linears.ggml_blocks import (BLOCK_BYTES, BLOCK_ELEMENTS, KERNEL_PATHS, GGMLBlocksLinear,  # noqa: E402
                                        GGMLBlocksWeight, vector_path)
from worker.linears.ggml_repack import repacked_weight  # noqa: E402
from worker.native_ops import cpu_ops_available  # noqa: E402

SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,)}


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, row bytes]: random codes, every f16 scale in [1e-3, 1e-2] (finite outputs)."""
    blocks = cols // BLOCK_ELEMENTS[type_name]
    raw = rng.integers(0, 256, size=(rows, blocks, BLOCK_BYTES[type_name]), dtype=np.uint8)
    for offset in SCALE_OFFSETS[type_name]:
        scales = rng.uniform(1e-3, 1e-2, size=(rows, blocks)).astype(np.float16)
        raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


def best_us(fn, repeat: int) -> float:
    return alternated_us([fn], repeat)[0]


def alternated_us(fns: list, repeat: int, medians: list | None = None) -> list[float]:
    """The best of `repeat` calls of each fn, called in turn (one round calls each once); with medians, their
    medians are appended to it."""
    for fn in fns:
        fn()
    seconds: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            started = time.perf_counter()
            fn()
            seconds[i].append(time.perf_counter() - started)
    if medians is not None:
        medians.extend(float(np.median(s)) * 1e6 for s in seconds)
    return [min(s) * 1e6 for s in seconds]


def cold(layer: dict, copies: int, rng: np.random.Generator, rows_of_x: int = 1) -> int:
    print(f"{rows_of_x} row(s) of x against {copies} copies of each weight in turn (not in cache), best of 4; "
          f"auto's kernel (AMX tiles for the K-quants from 6 rows where the CPU has them)")
    for name, parts in layer.items():
        for type_name, rows, cols in parts:
            linears = [GGMLBlocksLinear(GGMLBlocksWeight.from_blocks(type_name, random_blocks(type_name, rows, cols, rng),
                                                                     rows, cols)) for _ in range(copies)]
            x = torch.randn(rows_of_x, cols).to(torch.bfloat16)
            seconds = best_us(lambda: [linear(x) for linear in linears], 4) / 1e6
            total = sum(linear.weight_blocks.nbytes for linear in linears)
            print(f"{name:8s} {type_name} [{rows}, {cols}] rows of {linears[0].weight_blocks.nbytes // rows} bytes: "
                  f"{total / seconds / 1e9:5.1f} GB/s ({total / 1e6:.0f} MB)", flush=True)
    return 0


def print_layer_totals(totals: dict[int, list[float]]) -> None:
    """One layer's sums of each column per row count (us in, ms out)."""
    print("one layer, ms (best): " + "; ".join(
        f"{r} rows dot {t[0] / 1e3:.2f} tiles {t[1] / 1e3:.2f} gemm {t[2] / 1e3:.2f} repacked {t[3] / 1e3:.2f} "
        f"(dot / gemm {t[0] / t[2]:.2f}x, gemm / repacked {t[2] / t[3]:.2f}x) strips {t[4] / 1e3:.2f} "
        f"dequantized strips {t[8] / 1e3:.2f} "
        f"dense {t[5] / 1e3:.2f}" for r, t in totals.items()))
    print("one layer, ms (medians): " + "; ".join(
        f"{r} rows gemm {t[6] / 1e3:.2f} repacked {t[7] / 1e3:.2f} ({t[6] / t[7]:.2f}x)" for r, t in totals.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,32,64,128")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=8960)
    parser.add_argument("--kv", type=int, default=256, help="k and v rows each (kv heads x head_dim)")
    parser.add_argument("--cold", type=int, default=0, help="copies per weight cycled: the read rate out of cache")
    args = parser.parse_args()
    args.rows_given = any(arg.startswith("--rows") for arg in sys.argv[1:])
    if not cpu_ops_available():
        print("the compiled CPU ops are not built: .venv/bin/python scripts/build_cpu_ops.py")
        return 1
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    h, i, kv = args.hidden, args.intermediate, args.kv
    layer = {"qkv": [("Q4_K", h, h), ("Q4_K", kv, h), ("Q6_K", kv, h)], "o": [("Q4_K", h, h)],
             "gate_up": [("Q4_K", 2 * i, h)], "down": [("Q6_K", h, i)]}
    if args.cold:
        return cold(layer, args.cold, rng, int(args.rows.split(",")[0]) if args.rows_given else 1)
    tiles = torch.ops.tokenmill.ggml_blocks_path(0) == KERNEL_PATHS["amx_int8"]
    print(f"threads {args.threads}; us per call (min of {args.repeat}, variants alternated); dot = integer vector "
          f"kernel, tiles = AMX-INT8 tiles (K-quants; nan without AMX), gemm = the AVX2 GEMM (K-quants), repacked = "
          f"it on the weight repacked at load, strips = forward_strips (AMX-BF16 tiles on dequantized 32-row chunks where "
          f"the CPU has them), dq strips = dequantized strips + a torch GEMM each, dense = bf16 GEMM on a kept copy")
    print(f"{'linear':8s} {'rows':>5s} {'dot':>9s} {'tiles':>9s} {'gemm':>9s} {'repacked':>9s} {'strips':>9s} "
          f"{'dq strips':>9s} {'dense':>9s}  one-row GB/s")
    totals: dict[int, list[float]] = {}
    for name, parts in layer.items():
        weight = GGMLBlocksWeight.concat_rows([GGMLBlocksWeight.from_blocks(t, random_blocks(t, n, k, rng), n, k)
                                               for t, n, k in parts])
        linear, tiled, gemm = GGMLBlocksLinear(weight), GGMLBlocksLinear(weight), GGMLBlocksLinear(weight)
        linear.kernel_path = vector_path()
        tiled.kernel_path = KERNEL_PATHS["amx_int8"]
        gemm.kernel_path = KERNEL_PATHS["avx2_gemm"]
        packed = GGMLBlocksLinear(repacked_weight(weight))
        packed.kernel_path = KERNEL_PATHS["avx2_gemm"]
        dense = weight.dequantize().to(torch.bfloat16)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, weight.in_features).to(torch.bfloat16)
            variants = [lambda: linear.forward_rows(x), lambda: gemm.forward_rows(x), lambda: packed.forward_rows(x),
                        lambda: torch.nn.functional.linear(x, dense)]
            medians: list[float] = []
            timed = alternated_us(variants + ([lambda: tiled.forward_rows(x)] if tiles else []), args.repeat, medians)
            dot, avx2_gemm, repacked, dense_us = timed[:4]
            amx = timed[4] if tiles else float("nan")
            strips, dequantized = alternated_us([lambda: linear.forward_strips(x),
                                                 lambda: linear.forward_dequantized_strips(x)], max(3, args.repeat // 4))
            rate = f"{weight.nbytes / dot / 1e3:6.1f}" if rows == 1 else ""
            print(f"{name:8s} {rows:5d} {dot:9.0f} {amx:9.0f} {avx2_gemm:9.0f} {repacked:9.0f} {strips:9.0f} "
                  f"{dequantized:9.0f} {dense_us:9.0f}  {rate}", flush=True)
            totals.setdefault(rows, [0.0] * 9)
            for k, v in enumerate((dot, amx, avx2_gemm, repacked, strips, dense_us, medians[1], medians[2], dequantized)):
                totals[rows][k] += v
    print_layer_totals(totals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
