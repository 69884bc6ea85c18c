"""Decode attention on the paged cache alone (torch.ops.tokenmill.paged_decode_attention): microseconds a
call for R requests at one context length, bfloat16 and float32, with the default model's heads (9 query
heads over 3 KV heads of 64) and each request's pages scattered over a cache thirty layers deep.
Usage: OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_decode_attention.py [--requests 32] [--context 160] [--from-memory]
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker.native_ops import cpu_ops_available  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--from-memory", action="store_true",
                        help="each call reads other pages (30 layers' worth in turn), so they come from memory")
    args = parser.parse_args()
    if not cpu_ops_available():
        print("compiled CPU ops unavailable: run scripts/build_cpu_ops.py first")
        return 1
    heads, kv_heads, dim = (int(v) for v in args.heads.split(","))
    pages_each = -(-args.context // args.block_size)
    print(f"threads {torch.get_num_threads()}; {args.requests} requests of context {args.context}, heads {args.heads}")
    for dtype in (torch.bfloat16, torch.float32):
        num_blocks = args.requests * pages_each * 30
        key_cache = torch.randn(num_blocks, args.block_size, kv_heads, dim).to(dtype)
        value_cache = torch.randn(num_blocks, args.block_size, kv_heads, dim).to(dtype)
        tables = torch.randperm(num_blocks)[: args.requests * pages_each].view(args.requests, pages_each).contiguous()
        q = torch.randn(args.requests, heads, dim).to(dtype)
        out = torch.empty_like(q)
        rows = torch.arange(args.requests)
        lens = torch.full((args.requests,), args.context, dtype=torch.long)

        # --from-memory: each call reads another of 30 layers' page sets, as a step does (the other layers'
        # pages and the weights pass through the caches in between); otherwise one set, which stays in cache
        layers = 30 if args.from_memory else 1
        layer_tables = [torch.randperm(num_blocks)[: args.requests * pages_each].view(args.requests, pages_each)
                        .contiguous() for _ in range(layers - 1)] + [tables]
        calls = itertools.count()

        def call():
            layer_table = layer_tables[next(calls) % layers]
            torch.ops.tokenmill.paged_decode_attention(q, key_cache, value_cache, rows, layer_table, lens, dim**-0.5, 0,
                                                       0.0, out)

        for _ in range(5):
            call()
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(50):
                call()
            best = min(best, (time.perf_counter() - started) / 50)
        kv_bytes = 2 * args.requests * args.context * kv_heads * dim * key_cache.element_size()
        print(f"{str(dtype):15} {best * 1e6:7.0f} us a call   K/V read at {kv_bytes / best / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
