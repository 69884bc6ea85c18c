"""RMSNorm, and RMSNorm fused with the residual add that precedes it in every pre-norm block.

Rounding follows worker.model.llama.RMSNorm (the order HF uses): normalise in float32, round to the
activation dtype, then scale by the weight. The fused variant rounds x + residual to the activation
dtype before normalising it, exactly as the unfused `h = x + attn(...)` does, so both paths see the
same residual stream.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.checks import FLOAT_DTYPES, check_tensor, output_tensor

# one program holds a whole row in registers; 64k floats is beyond any hidden size we serve
MAX_HIDDEN_SIZE = 65536


@triton.jit
def _rms_norm_kernel(
    # pointers
    x_ptr,  # [T, hidden]
    residual_ptr,  # [T, hidden]; read only when HAS_RESIDUAL
    weight_ptr,  # [hidden]
    out_ptr,  # [T, hidden]
    residual_out_ptr,  # [T, hidden]; x + residual, written only when HAS_RESIDUAL
    # sizes
    hidden_size,
    eps,
    # strides (the last dimension of every row is contiguous)
    stride_x_row,
    stride_residual_row,
    stride_out_row,
    stride_residual_out_row,
    # meta-parameters
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # next power of two >= hidden_size
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual_row + cols, mask=mask, other=0.0)
        # round the sum to the activation dtype first: that is the residual stream the model keeps
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_residual_out_row + cols, x, mask=mask)
    x_fp32 = x.to(tl.float32)
    mean_square = tl.sum(x_fp32 * x_fp32, axis=0) / hidden_size
    normed = (x_fp32 * tl.rsqrt(mean_square + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_inputs(where: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    check_tensor(where, "x", x, (None, None), FLOAT_DTYPES)
    hidden_size = x.shape[1]
    if hidden_size > MAX_HIDDEN_SIZE:
        raise ValueError(f"{where}: x has hidden size {hidden_size}, above the limit {MAX_HIDDEN_SIZE}")
    check_tensor(where, "weight", weight, (hidden_size,), (x.dtype,), x.device)


def _check_like_x(where: str, name: str, tensor: torch.Tensor, x: torch.Tensor) -> None:
    check_tensor(where, name, tensor, tuple(x.shape), (x.dtype,), x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, hidden] (rows may be strided, the last dim contiguous); weight: [hidden], x's dtype.

    Returns out [T, hidden] in x's dtype (allocated when None, else written and returned).
    """
    _check_inputs("rms_norm", x, weight)
    out = output_tensor("rms_norm", "out", out, tuple(x.shape), x)
    return _launch(x, x, weight, eps, out, out, has_residual=False)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, hidden], same dtype; weight: [hidden]. Returns (rms_norm(x + residual), x + residual).

    Outputs are allocated when None. residual_out may be `residual` itself (or x) to update the
    residual stream in place: each element is read before its own slot is written.
    """
    _check_inputs("fused_add_rms_norm", x, weight)
    _check_like_x("fused_add_rms_norm", "residual", residual, x)
    out = output_tensor("fused_add_rms_norm", "out", out, tuple(x.shape), x)
    residual_out = output_tensor("fused_add_rms_norm", "residual_out", residual_out, tuple(x.shape), x)
    _launch(x, residual, weight, eps, out, residual_out, has_residual=True)
    return out, residual_out


def _launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor,
            residual_out: torch.Tensor, has_residual: bool) -> torch.Tensor:
    """One program per row; without a residual, x and out stand in for residual and residual_out."""
    if x.shape[0] > 0:
        _rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, out, residual_out,
            x.shape[1], eps,
            x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
            HAS_RESIDUAL=has_residual, BLOCK_SIZE=triton.next_power_of_2(x.shape[1]),
        )  # fmt: skip
    return out
