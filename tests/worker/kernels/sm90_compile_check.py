"""Compile the paged-attention and KV-write kernels for an H100/H200 (sm_90) on a machine without a GPU.

The interpreter tests prove the kernels' arithmetic, not that the real compiler accepts them; this
runs the whole Triton pipeline down to a cubin, with the divisible-by-16 hints a real launch gives
pointers and strides, and prints each kernel's registers and spills (from ptxas -v). Not a pytest
test (about a minute per variant on a shared CPU). Run:

    python -m tests.worker.kernels.sm90_compile_check [fp16|bf16|fp32 ...]
"""
from __future__ import annotations

import os
import subprocess
import sys

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compile, don't interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from worker.kernels import kv_write, paged_decode_attention, prefill_attention  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")


def compile_kernel(kernel, pointer_types: dict[str, str], constexprs: dict, num_warps: int = 4) -> str:
    """Unlisted non-constexpr arguments are i32; returns one line of ptxas -v figures."""
    signature = {name: "constexpr" if name in constexprs else pointer_types.get(name, "i32") for name in kernel.arg_names}
    aligned = {
        (index,): [["tt.divisibility", 16]]
        for index, name in enumerate(kernel.arg_names)
        if name not in constexprs and (name.endswith("_ptr") or name.startswith("stride_"))
    }
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, aligned), target=TARGET, options={"num_warps": num_warps})
    ptx_path = f"/tmp/{kernel.__name__}.ptx"
    with open(ptx_path, "w") as ptx_file:
        ptx_file.write(compiled.asm["ptx"])
    result = subprocess.run([PTXAS, "-arch=sm_90a", "-v", ptx_path, "-o", "/dev/null"], capture_output=True, text=True)
    figures = [line.split(":", 1)[-1].strip() for line in result.stderr.splitlines() if "registers" in line or "spill" in line]
    return "; ".join(figures) or result.stderr.strip()


def main(dtypes: list[str]) -> None:
    for dtype in dtypes:
        precision = "ieee" if dtype == "fp32" else "tf32"
        cache = {name: f"*{dtype}" for name in ("query_ptr", "key_cache_ptr", "value_cache_ptr", "out_ptr")}
        cache.update(block_tables_ptr="*i32", context_lens_ptr="*i32", query_start_loc_ptr="*i32", scale_log2="fp32")
        for num_splits in (1, 4):
            types = dict(cache, out_ptr="*fp32" if num_splits > 1 else f"*{dtype}", lse_ptr="*fp32")
            constexprs = dict(BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_G=16, BLOCK_N=64, NUM_SPLITS=num_splits, PRECISION=precision, UPCAST=False)
            print(dtype, f"decode, {num_splits} split(s):", compile_kernel(paged_decode_attention._paged_decode_kernel, types, constexprs))
        merge = dict(partial_ptr="*fp32", lse_ptr="*fp32", out_ptr=f"*{dtype}")
        print(dtype, "merge:", compile_kernel(paged_decode_attention._merge_splits_kernel, merge, dict(NUM_SPLITS=4, BLOCK_S=4, HEAD_DIM=128)))
        for group, head_dim in ((4, 128), (3, 64)):
            block_m, block_n, num_warps = prefill_attention._tiles(TORCH_DTYPES[dtype], head_dim, group)
            constexprs = dict(BLOCK_SIZE=16, HEAD_DIM=head_dim, QUERIES_PER_KV=group, BLOCK_Q=block_m // group,
                              BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=precision, UPCAST=False)
            print(dtype, f"prefill, G={group}, D={head_dim}:", compile_kernel(prefill_attention._prefill_kernel, cache, constexprs, num_warps))
        tensors = {name: f"*{dtype}" for name in ("key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr")}
        tensors.update(slot_mapping_ptr="*i64")
        constexprs = dict(BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128)
        print(dtype, "write_kv:", compile_kernel(kv_write._write_kv_kernel, tensors, constexprs))


if __name__ == "__main__":
    main(sys.argv[1:] or ["bf16", "fp16", "fp32"])
