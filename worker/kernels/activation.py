"""SiLU(gate) * up, the activation of the gated MLP (worker.model.llama.MLP), in one pass.

gate and up are usually the two halves of the fused gate_up projection output ([T, 2I] -> two
[T, I] views with row stride 2I), so rows may be strided; the output is a fresh [T, I].
The product is computed in float32 and rounded once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.checks import FLOAT_DTYPES, check_tensor, output_tensor

BLOCK_SIZE = 1024  # columns per program: wide enough to stream, small enough for the interpreter


@triton.jit
def _silu_and_mul_kernel(
    # pointers
    gate_ptr,  # [T, I]
    up_ptr,  # [T, I]
    out_ptr,  # [T, I]
    # sizes
    intermediate_size,
    # strides (the last dimension of every tensor is contiguous)
    stride_gate_row,
    stride_up_row,
    stride_out_row,
    # meta-parameters
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < intermediate_size
    gate = tl.load(gate_ptr + row * stride_gate_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * stride_up_row + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate, up: [T, I], same dtype (rows may be strided, e.g. `gate_up.chunk(2, dim=-1)`).

    Returns out [T, I] = silu(gate) * up in their dtype (allocated when None, else written and returned).
    """
    check_tensor("silu_and_mul", "gate", gate, (None, None), FLOAT_DTYPES)
    check_tensor("silu_and_mul", "up", up, tuple(gate.shape), (gate.dtype,), gate.device)
    out = output_tensor("silu_and_mul", "out", out, tuple(gate.shape), gate)
    num_tokens, intermediate_size = gate.shape
    if num_tokens == 0 or intermediate_size == 0:
        return out
    block_size = min(BLOCK_SIZE, triton.next_power_of_2(intermediate_size))
    grid = (num_tokens, triton.cdiv(intermediate_size, block_size))
    _silu_and_mul_kernel[grid](
        gate, up, out,
        intermediate_size,
        gate.stride(0), up.stride(0), out.stride(0),
        BLOCK_SIZE=block_size,
    )  # fmt: skip
    return out
