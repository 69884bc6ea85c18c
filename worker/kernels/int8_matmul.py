"""INT8 weight-only matmul: y = x @ (qweight * scales[:, None]).T + bias, dequantized inside the kernel.

Symmetric per-output-channel quantization: scales[n] = max |weight[n, :]| / 127 and
qweight = round(weight / scales[:, None]) in [-127, 127]. The scale is constant along K, so the kernel
multiplies int8 values (exact in fp16 / bf16) into a float32 accumulator and applies the scale once per
output after the K loop: the weights cross memory as one byte each, which is the point in decode,
where the matmul is bound by weight bandwidth.

int8_weight_matmul_torch is the same computation in plain torch, for the CPU path (--quantization
int8 without CUDA) and as the reference in the tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from worker.kernels.checks import FLOAT_DTYPES, check_tensor, output_tensor

INT8_MAX = 127


@triton.jit
def _int8_weight_matmul_kernel(
    # pointers
    x_ptr,  # [M, K] float
    qweight_ptr,  # [N, K] int8
    scales_ptr,  # [N] float32
    bias_ptr,  # [N], x's dtype; read only when HAS_BIAS
    out_ptr,  # [M, N], x's dtype
    # sizes
    M, N, K,
    # strides (the K dimension of x and qweight is contiguous)
    stride_x_row, stride_qweight_row, stride_out_row,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in float32 (bfloat16 under the interpreter, see _dot_dtype)
    INPUT_PRECISION: tl.constexpr,  # "ieee" for float32 operands: tf32 would miss the float32 tolerance
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    depth = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_x_row + depth[None, :]  # [BLOCK_M, BLOCK_K]
    # the weight tile is read transposed, [BLOCK_K, BLOCK_N], so that tl.dot(x, w) is x @ w.T
    w_ptrs = qweight_ptr + cols.to(tl.int64)[None, :] * stride_qweight_row + depth[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        depth_mask = (start + depth) < K
        x = tl.load(x_ptrs + start, mask=(rows[:, None] < M) & depth_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + start, mask=depth_mask[:, None] & (cols[None, :] < N), other=0)
        if UPCAST:
            x = x.to(tl.float32)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=INPUT_PRECISION)
    scales = tl.load(scales_ptr + cols, mask=cols < N, other=0.0)
    out = acc * scales[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def quantize_int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [N, K] float -> (qweight [N, K] int8, contiguous; scales [N] float32), on weight's device.

    An all-zero row gets scale 1 (any scale reproduces it; 0 would divide by zero).
    """
    check_tensor("quantize_int8_weight", "weight", weight, (None, None), FLOAT_DTYPES, last_dim_contiguous=False)
    weight = weight.float()
    max_abs = weight.abs().amax(dim=1)  # [N]
    scales = torch.where(max_abs > 0, max_abs / INT8_MAX, torch.ones_like(max_abs))
    qweight = (weight / scales.unsqueeze(1)).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return qweight.contiguous(), scales


def _check_matmul_inputs(
    where: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> None:
    check_tensor(where, "x", x, (None, None), FLOAT_DTYPES)
    check_tensor(where, "qweight", qweight, (None, x.shape[1]), (torch.int8,), x.device)
    num_outputs = qweight.shape[0]
    check_tensor(where, "scales", scales, (num_outputs,), (torch.float32,), x.device)
    if bias is not None:
        check_tensor(where, "bias", bias, (num_outputs,), (x.dtype,), x.device)


def int8_weight_matmul_torch(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [M, K] float; qweight: [N, K] int8; scales: [N] float32; bias: [N] or None -> [M, N] in x's dtype.

    Plain torch, in float32 (an unscaled int8 product can overflow float16), rounded once at the end.
    """
    _check_matmul_inputs("int8_weight_matmul_torch", x, qweight, scales, bias)
    out = F.linear(x.float(), qweight.float()) * scales  # [M, N]
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def _dot_dtype_upcast(x: torch.Tensor) -> bool:
    # The Triton interpreter multiplies bfloat16 tl.dot operands as the raw uint16 bit patterns it stores
    # them in, so off CUDA the kernel multiplies in float32; on CUDA bf16 x int8->bf16 is exact and fast.
    return x.dtype == torch.bfloat16 and x.device.type != "cuda"


def _block_sizes(num_rows: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K). Small M is decode: narrow N tiles give enough programs to keep every
    SM streaming weights. Not tuned on a device yet."""
    if num_rows <= 16:
        return 16, 32, 128
    if num_rows <= 64:
        return 64, 64, 64
    return 128, 64, 64


def int8_weight_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [M, K] float (rows may be strided); qweight: [N, K] int8; scales: [N] float32; bias: [N] in x's
    dtype or None -> out [M, N] in x's dtype (allocated when None, else written and returned)."""
    _check_matmul_inputs("int8_weight_matmul", x, qweight, scales, bias)
    num_rows, depth = x.shape
    num_outputs = qweight.shape[0]
    out = output_tensor("int8_weight_matmul", "out", out, (num_rows, num_outputs), x)
    if num_rows == 0 or num_outputs == 0:
        return out
    upcast = _dot_dtype_upcast(x)
    block_m, block_n, block_k = _block_sizes(num_rows)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_outputs, block_n))
    _int8_weight_matmul_kernel[grid](
        x, qweight, scales, bias if bias is not None else scales, out,
        num_rows, num_outputs, depth,
        x.stride(0), qweight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None,
        UPCAST=upcast,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out
