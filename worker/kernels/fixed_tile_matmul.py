"""Batch-invariant matmul: y = x @ W.T (times a per-output-channel scale) + bias, in one tile configuration
for every row count.

Deterministic mode (worker.paths.triton.batch_invariant) runs the float and int8 linears of the Triton path
through this kernel. Why a kernel of its own: cuBLAS picks its algorithm, tiles and split-K from the shape,
and worker.kernels.int8_matmul / group_quant_matmul pick their tiles from the row count, so a row's sum
over K runs in another order when its step holds another number of rows, and greedy output then depends
on what else ran beside a request (Thinking Machines, "Defeating Nondeterminism in LLM Inference";
vLLM's batch-invariant mode). Here BLOCK_M, BLOCK_N, BLOCK_K and num_warps are constants (FIXED_TILE), so
every output element is one program's K loop in BLOCK_K steps from k = 0 with the same instructions,
whatever M is and wherever the row sits in its tile; M only changes how many programs run. No split-K.
M is not specialized on (the compiler sees the same kernel for M = 1 as for M = 4096).

Weights: float in x's dtype (nn.Linear's), or int8 with one float32 scale per output channel
(worker.linears.int8's format, worker.kernels.int8_matmul's arithmetic): an int8 tile becomes x's dtype
in the K loop (exact), and the scale multiplies the float32 sum after it. The result is rounded once.

FIXED_TILE is a first guess, not tuned on a device: decode (few rows) wants narrow column tiles so that
enough programs stream the weight, prefill wants tall ones. Its cost on a GPU is unmeasured.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.checks import FLOAT_DTYPES, check_tensor, output_tensor

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for every call, whatever the row count
FIXED_TILE = (32, 64, 64, 4)


@triton.jit(do_not_specialize=["M"])
def _fixed_tile_matmul_kernel(
    # pointers
    x_ptr,  # [M, K] float
    weight_ptr,  # [N, K]: x's dtype, or int8 when HAS_SCALES
    scales_ptr,  # [N] float32; read only when HAS_SCALES
    bias_ptr,  # [N] x's dtype; read only when HAS_BIAS
    out_ptr,  # [M, N] x's dtype
    # sizes
    M, N, K,
    # strides (the K dimension of x and weight is contiguous)
    stride_x_row, stride_weight_row, stride_out_row,
    # meta-parameters
    HAS_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in float32: the interpreter's bfloat16 tl.dot is wrong (see _upcast)
    INPUT_PRECISION: tl.constexpr,  # "ieee" for float32 operands: tf32 would round them
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    depth = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    row_mask, col_mask = rows < M, cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x_row + depth[None, :]  # [BLOCK_M, BLOCK_K]
    # the weight tile is read transposed, [BLOCK_K, BLOCK_N], so that tl.dot(x, w) is x @ w.T
    w_ptrs = weight_ptr + cols.to(tl.int64)[None, :] * stride_weight_row + depth[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # rows past M load zeros: they share a tile with real rows but never a sum
    for start in range(0, K, BLOCK_K):
        depth_mask = (start + depth) < K
        x = tl.load(x_ptrs + start, mask=row_mask[:, None] & depth_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + start, mask=depth_mask[:, None] & col_mask[None, :], other=0)
        if UPCAST:
            x = x.to(tl.float32)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=INPUT_PRECISION)
    if HAS_SCALES:
        acc = acc * tl.load(scales_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _upcast(x: torch.Tensor) -> bool:
    # The Triton interpreter multiplies bfloat16 tl.dot operands as the raw uint16 bit patterns it stores
    # them in, so off CUDA the kernel multiplies in float32 (bf16 x bf16 products are exact in float32)
    return x.dtype == torch.bfloat16 and x.device.type != "cuda"


def fixed_tile_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [M, K] float (rows may be strided); weight: [N, K] in x's dtype, or int8 with scales [N] float32;
    bias: [N] in x's dtype or None -> out [M, N] in x's dtype (allocated when None, else written and
    returned). Row m of out is the same bits whatever the other rows of x are and however many."""
    where = "fixed_tile_matmul"
    check_tensor(where, "x", x, (None, None), FLOAT_DTYPES)
    num_rows, depth = x.shape
    if scales is None:
        check_tensor(where, "weight", weight, (None, depth), (x.dtype,), x.device, dtype_from="x")
    else:
        check_tensor(where, "weight", weight, (None, depth), (torch.int8,), x.device)
        check_tensor(where, "scales", scales, (weight.shape[0],), (torch.float32,), x.device)
    num_outputs = weight.shape[0]
    if bias is not None:
        check_tensor(where, "bias", bias, (num_outputs,), (x.dtype,), x.device, dtype_from="x")
    out = output_tensor(where, "out", out, (num_rows, num_outputs), x, dtype_from="x")
    if num_rows == 0 or num_outputs == 0:
        return out
    block_m, block_n, block_k, num_warps = FIXED_TILE
    upcast = _upcast(x)
    any_pointer = weight  # for the scales / bias the kernel does not read
    _fixed_tile_matmul_kernel[(triton.cdiv(num_rows, block_m), triton.cdiv(num_outputs, block_n))](
        x, weight, scales if scales is not None else any_pointer, bias if bias is not None else any_pointer, out,
        num_rows, num_outputs, depth,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_SCALES=scales is not None, HAS_BIAS=bias is not None, UPCAST=upcast,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
    )  # fmt: skip
    return out
