"""Compile every Triton kernel for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter tests prove the kernels' arithmetic, not that the real compiler accepts them: the
interpreter runs plain Python, so a jit function that reads a non-constexpr global, or an op the compiler
does not lower, passes every CPU test and fails on the first GPU (seen: paged_shared's LOG2_E in the
softcap branch, 2026-12-04). This runs the whole Triton pipeline down to a cubin for each kernel and each
constexpr branch the launchers take, with the divisible-by-16 hints a real launch gives pointers and
strides. tests/worker/kernels/test_sm90_compile.py runs it in CI; by hand it also prints each kernel's
registers and spills (ptxas -v):

    python -m tests.worker.kernels.sm90_compile_check [--quiet] [fp16|bf16|fp32 ...]
"""
from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compile, don't interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from worker.kernels import (  # noqa: E402
    activation, fused_moe, group_quant_matmul, int8_matmul, kv_write, paged_decode_attention, prefill_attention,
    rms_norm, rotary, sampling,
)

TARGET = GPUTarget("cuda", 90, 32)
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")


@dataclass
class Variant:
    name: str
    kernel: object
    pointer_types: dict[str, str]  # unlisted non-constexpr arguments are i32
    constexprs: dict = field(default_factory=dict)
    num_warps: int = 4


def compile_variant(variant: Variant, report: bool) -> str:
    """Compiles to a cubin (raises on a compile error); with report, one line of ptxas -v figures."""
    kernel, constexprs = variant.kernel, variant.constexprs
    signature = {name: "constexpr" if name in constexprs else variant.pointer_types.get(name, "i32")
                 for name in kernel.arg_names}
    aligned = {
        (index,): [["tt.divisibility", 16]]
        for index, name in enumerate(kernel.arg_names)
        if name not in constexprs and (name.endswith("_ptr") or name.startswith("stride_"))
    }
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, aligned), target=TARGET,
                              options={"num_warps": variant.num_warps})
    if not report:
        return "cubin" if compiled.asm.get("cubin") else "no cubin"
    ptx_path = f"/tmp/{kernel.__name__}.ptx"
    with open(ptx_path, "w") as ptx_file:
        ptx_file.write(compiled.asm["ptx"])
    result = subprocess.run([PTXAS, "-arch=sm_90a", "-v", ptx_path, "-o", "/dev/null"], capture_output=True, text=True)
    figures = [line.split(":", 1)[-1].strip() for line in result.stderr.splitlines() if "registers" in line or "spill" in line]
    return "; ".join(figures) or result.stderr.strip()


def attention_variants(dtype: str) -> Iterator[Variant]:
    precision = "ieee" if dtype == "fp32" else "tf32"
    cache = {name: f"*{dtype}" for name in ("query_ptr", "key_cache_ptr", "value_cache_ptr", "out_ptr")}
    cache.update(block_tables_ptr="*i32", context_lens_ptr="*i32", query_start_loc_ptr="*i32", scale_log2="fp32",
                 softcap="fp32", key_scale_ptr="*fp16", value_scale_ptr="*fp16", sinks_ptr=f"*{dtype}")
    for softcap in (False, True):  # the softcap branch is the one the interpreter hid a compile error in
        for num_splits in (1, 4):
            types = dict(cache, out_ptr="*fp32" if num_splits > 1 else f"*{dtype}", lse_ptr="*fp32")
            constexprs = dict(BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_G=16, BLOCK_N=64, NUM_SPLITS=num_splits,
                              PRECISION=precision, UPCAST=False, SOFTCAP=softcap, KV_QUANT=False,
                              HAS_SINKS=False)
            yield Variant(f"{dtype} decode, {num_splits} split(s), softcap {softcap}",
                          paged_decode_attention._paged_decode_kernel, types, constexprs)
        for group, head_dim in ((4, 128), (3, 64)):
            block_m, block_n, num_warps = prefill_attention._tiles(TORCH_DTYPES[dtype], head_dim, group)
            constexprs = dict(BLOCK_SIZE=16, HEAD_DIM=head_dim, QUERIES_PER_KV=group, BLOCK_Q=block_m // group,
                              BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, UPCAST=False, SOFTCAP=softcap,
                              KV_QUANT=False, HAS_SINKS=False)
            yield Variant(f"{dtype} prefill, G={group}, D={head_dim}, softcap {softcap}", prefill_attention._prefill_kernel,
                          cache, constexprs, num_warps)
    yield from quantized_page_variants(dtype, cache, precision)
    yield from sink_variants(dtype, cache, precision)
    merge = dict(partial_ptr="*fp32", lse_ptr="*fp32", out_ptr=f"*{dtype}")
    yield Variant(f"{dtype} merge", paged_decode_attention._merge_splits_kernel, merge,
                  dict(NUM_SPLITS=4, BLOCK_S=4, HEAD_DIM=128))
    tensors = {name: f"*{dtype}" for name in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")}
    yield Variant(f"{dtype} write_kv", kv_write._write_kv_kernel, dict(tensors, slot_mapping_ptr="*i64"),
                  dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, QMAX=0.0))


def sink_variants(dtype: str, cache: dict[str, str], precision: str) -> Iterator[Variant]:
    """gpt-oss's attention sinks (its heads: 64 query on 8 KV, head_dim 64) in both attention kernels."""
    for num_splits in (1, 4):
        types = dict(cache, out_ptr="*fp32" if num_splits > 1 else f"*{dtype}", lse_ptr="*fp32")
        constexprs = dict(BLOCK_SIZE=16, HEAD_DIM=64, BLOCK_G=16, BLOCK_N=64, NUM_SPLITS=num_splits,
                          PRECISION=precision, UPCAST=False, SOFTCAP=False, KV_QUANT=False, HAS_SINKS=True)
        yield Variant(f"{dtype} decode, {num_splits} split(s), sinks", paged_decode_attention._paged_decode_kernel,
                      types, constexprs)
    block_m, block_n, num_warps = prefill_attention._tiles(TORCH_DTYPES[dtype], 64, 8)
    constexprs = dict(BLOCK_SIZE=16, HEAD_DIM=64, QUERIES_PER_KV=8, BLOCK_Q=block_m // 8, BLOCK_M=block_m,
                      BLOCK_N=block_n, PRECISION=precision, UPCAST=False, SOFTCAP=False, KV_QUANT=False, HAS_SINKS=True)
    yield Variant(f"{dtype} prefill, sinks", prefill_attention._prefill_kernel, cache, constexprs, num_warps)


def quantized_page_variants(dtype: str, cache: dict[str, str], precision: str) -> Iterator[Variant]:
    """--kv-cache-dtype int8 / fp8_e4m3: the KV write's quantizer and both attention kernels' dequantizing reads."""
    for page_type, qmax in (("i8", 127.0), ("fp8e4nv", 448.0)):
        pages = dict(cache, key_cache_ptr=f"*{page_type}", value_cache_ptr=f"*{page_type}")
        constexprs = dict(BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_G=16, BLOCK_N=64, NUM_SPLITS=1, PRECISION=precision,
                          UPCAST=False, SOFTCAP=False, KV_QUANT=True, HAS_SINKS=False)
        yield Variant(f"{dtype} decode, {page_type} pages", paged_decode_attention._paged_decode_kernel, pages, constexprs)
        block_m, block_n, num_warps = prefill_attention._tiles(TORCH_DTYPES[dtype], 64, 3)
        constexprs = dict(BLOCK_SIZE=16, HEAD_DIM=64, QUERIES_PER_KV=3, BLOCK_Q=block_m // 3, BLOCK_M=block_m,
                          BLOCK_N=block_n, PRECISION=precision, UPCAST=False, SOFTCAP=False, KV_QUANT=True,
                          HAS_SINKS=False)
        yield Variant(f"{dtype} prefill, {page_type} pages", prefill_attention._prefill_kernel, pages, constexprs,
                      num_warps)
        tensors = dict(key_ptr=f"*{dtype}", value_ptr=f"*{dtype}", key_cache_ptr=f"*{page_type}",
                       value_cache_ptr=f"*{page_type}", key_scale_ptr="*fp16", value_scale_ptr="*fp16",
                       slot_mapping_ptr="*i64")
        yield Variant(f"{dtype} write_kv, {page_type} pages", kv_write._write_kv_kernel, tensors,
                      dict(BLOCK_SIZE=16, BLOCK_H=4, BLOCK_D=64, QMAX=qmax))


def linear_variants(dtype: str) -> Iterator[Variant]:
    precision = "ieee" if dtype == "fp32" else "tf32"
    types = dict(x_ptr=f"*{dtype}", codes_ptr="*u8", scales_ptr="*fp32", mins_ptr="*fp32", bias_ptr="*fp32",
                 out_ptr=f"*{dtype}")
    for bits, group_size in group_quant_matmul.LAYOUTS:
        block_m, block_n = group_quant_matmul._block_sizes(64)
        constexprs = dict(BITS=bits, GROUP_SIZE=group_size, HAS_BIAS=False, UPCAST=False,
                          INPUT_PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n)
        yield Variant(f"{dtype} group_quant {bits}-bit/{group_size}, tiled", group_quant_matmul._group_quant_matmul_kernel,
                      types, constexprs)
        block_n, block_groups, num_warps = group_quant_matmul.GEMV_CONFIG
        for rows in (1, group_quant_matmul.GEMV_MAX_ROWS):
            constexprs = dict(BITS=bits, GROUP_SIZE=group_size, GROUP_BYTES=group_size * bits // 8, HAS_BIAS=rows == 1,
                              ROWS=rows, BLOCK_N=block_n, BLOCK_GROUPS=block_groups)
            yield Variant(f"{dtype} group_quant {bits}-bit/{group_size}, GEMV {rows} row(s)",
                          group_quant_matmul._group_quant_gemv_kernel, types, constexprs, num_warps)
        for rows in (16, 64):
            block_m, block_n, block_groups, num_warps = group_quant_matmul._dequant_config(rows)
            constexprs = dict(BITS=bits, GROUP_SIZE=group_size, HAS_BIAS=rows == 16, UPCAST=False,
                              INPUT_PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_GROUPS=block_groups)
            yield Variant(f"{dtype} group_quant {bits}-bit/{group_size}, dequant {rows} rows",
                          group_quant_matmul._group_quant_dequant_kernel, types, constexprs, num_warps)
    types = dict(x_ptr=f"*{dtype}", qweight_ptr="*i8", scales_ptr="*fp32", bias_ptr=f"*{dtype}", out_ptr=f"*{dtype}")
    constexprs = dict(HAS_BIAS=True, UPCAST=False, INPUT_PRECISION=precision, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)
    yield Variant(f"{dtype} int8_matmul", int8_matmul._int8_weight_matmul_kernel, types, constexprs)


def fused_moe_variants(dtype: str) -> Iterator[Variant]:
    """The expert matmul at each tile size, for gate/up (no routing weight) and down (routing weight), on float
    weights; on every group-quantized layout, gate/up at the decode tile and down at the prefill one."""
    precision = "ieee" if dtype == "fp32" else "tf32"
    types = dict(x_ptr=f"*{dtype}", out_ptr=f"*{dtype}", pair_weights_ptr="*fp32", sorted_pairs_ptr="*i32",
                 block_experts_ptr="*i32", bias_ptr=f"*{dtype}")
    weights = [("float", dict(weight_ptr=f"*{dtype}", scales_ptr=f"*{dtype}", mins_ptr=f"*{dtype}"), 0, 1)]
    weights += [(f"{bits}-bit/{group_size}", dict(weight_ptr="*u8", scales_ptr="*fp32", mins_ptr="*fp32"), bits,
                 group_size) for bits, group_size in group_quant_matmul.LAYOUTS]
    for label, weight_types, bits, group_size in weights:
        for pairs_per_expert in (1, 32, 128):  # each of block_sizes' tiles
            block_m, block_n, block_k = fused_moe.block_sizes(pairs_per_expert * 8, 8)
            for rows_per_token, routed in ((8, False), (1, True)):
                if bits and routed != (pairs_per_expert == 128):
                    continue
                # gpt-oss's biases on the float weights' tiles
                for bias in (False, True) if not bits else (False,):
                    constexprs = dict(ROWS_PER_TOKEN=rows_per_token, BITS=bits, GROUP_SIZE=group_size,
                                      HAS_PAIR_WEIGHTS=routed, HAS_BIAS=bias, UPCAST=False, INPUT_PRECISION=precision,
                                      BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
                    yield Variant(f"{dtype} fused_moe {label}{', biases' if bias else ''}, BLOCK_M {block_m}, "
                                  f"{'down' if routed else 'gate/up'}",
                                  fused_moe._expert_matmul_kernel, dict(types, **weight_types), constexprs)


def elementwise_variants(dtype: str) -> Iterator[Variant]:
    for residual in (False, True):
        types = {name: f"*{dtype}" for name in ("x_ptr", "residual_ptr", "weight_ptr", "out_ptr", "residual_out_ptr")}
        yield Variant(f"{dtype} rms_norm, residual {residual}", rms_norm._rms_norm_kernel, dict(types, eps="fp32"),
                      dict(HAS_RESIDUAL=residual, BLOCK_SIZE=4096))
    types = dict(query_ptr=f"*{dtype}", key_ptr=f"*{dtype}", cos_ptr="*fp32", sin_ptr="*fp32")
    yield Variant(f"{dtype} rotary", rotary._rotary_kernel, types, dict(BLOCK_HEADS=32, BLOCK_KV_HEADS=8, BLOCK_HALF=64))
    types = {name: f"*{dtype}" for name in ("gate_ptr", "up_ptr", "out_ptr")}
    yield Variant(f"{dtype} silu_and_mul", activation._silu_and_mul_kernel, types, dict(BLOCK_SIZE=activation.BLOCK_SIZE))
    types = dict(logits_ptr=f"*{dtype}", temperature_ptr="*fp32", threshold_ptr="*fp32", seeds_ptr="*i64",
                 bitmask_ptr="*i32", out_ptr="*i64", greedy_temperature="fp32")
    for threshold, bitmask, rows in ((False, False, 1), (True, True, 1), (True, False, 8)):
        yield Variant(f"{dtype} sample, threshold {threshold}, bitmask {bitmask}, {rows} row(s)", sampling._sample_kernel,
                      types, dict(USE_THRESHOLD=threshold, USE_BITMASK=bitmask, BLOCK_ROWS=rows,
                                  BLOCK_VOCAB=sampling.BLOCK_VOCAB))
    yield Variant("exponential_noise", sampling._exponential_noise_kernel, dict(seeds_ptr="*i64", out_ptr="*fp32"),
                  dict(BLOCK_ROWS=1, BLOCK_VOCAB=sampling.BLOCK_VOCAB))


def variants(dtypes: list[str]) -> Iterator[Variant]:
    """Every kernel in bf16 (or the first dtype asked for); the dot-product kernels in every dtype, since
    float32 takes the ieee-precision branch."""
    for index, dtype in enumerate(dtypes):
        yield from attention_variants(dtype)
        yield from linear_variants(dtype)
        yield from fused_moe_variants(dtype)
        if index == 0:
            yield from elementwise_variants(dtype)


def main(argv: list[str]) -> int:
    report = "--quiet" not in argv
    dtypes = [arg for arg in argv if not arg.startswith("--")] or ["bf16", "fp16", "fp32"]
    failed = 0
    for variant in variants(dtypes):
        try:
            print(f"{variant.name}: {compile_variant(variant, report)}", flush=True)
        except Exception as error:  # report every kernel, then fail
            failed += 1
            print(f"{variant.name}: FAILED {type(error).__name__}: {error}", flush=True)
    print(f"{failed} kernel variant(s) failed to compile for sm_90" if failed else "every kernel variant compiled for sm_90")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
