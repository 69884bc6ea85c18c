"""Rotary position embedding applied in place to q and k, in worker.model.llama's convention.

worker.model.rope_cos_sin gives cos = cat(cos, cos) and signed_sin = cat(-sin, sin), [T, 1, D], and
apply_rope computes x * cos + cat(x2, x1) * signed_sin (HF's rotate_half with the sign folded in).
The kernel computes exactly that expression from the tables it is given, so it assumes nothing about
how they were built. One rounding at the end (products and sum in float32), where the torch version
rounds each product to the activation dtype first: the kernel is the closer of the two to the exact value.

In place because q and k are views of the fused qkv projection output: rotating them there costs no
allocation and leaves v untouched. One program per token covers all its q and k heads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.checks import FLOAT_DTYPES, check_tensor


@triton.jit
def _rotate_heads(
    x_ptr,  # this token's [heads, D] slice, rotated in place
    cos_first, cos_second, sin_first, sin_second,  # [1, BLOCK_HALF] float32, this token's tables split in halves
    num_heads, half_dim, stride_head,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    heads = tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
    cols = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    mask = (heads < num_heads) & (cols < half_dim)
    first_ptrs = x_ptr + heads * stride_head + cols
    x_first = tl.load(first_ptrs, mask=mask, other=0.0).to(tl.float32)  # x1
    x_second = tl.load(first_ptrs + half_dim, mask=mask, other=0.0).to(tl.float32)  # x2
    # x * cos + cat(x2, x1) * signed_sin, one half at a time; both halves are loaded before either store
    out_first = x_first * cos_first + x_second * sin_first
    out_second = x_second * cos_second + x_first * sin_second
    tl.store(first_ptrs, out_first.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first_ptrs + half_dim, out_second.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    # pointers
    query_ptr,  # [T, H, D], rotated in place
    key_ptr,  # [T, KVH, D], rotated in place
    cos_ptr,  # [T, D]
    sin_ptr,  # [T, D], signed: cat(-sin, sin)
    # sizes
    num_heads,
    num_kv_heads,
    half_dim,  # D / 2
    # strides (the last dimension of every tensor is contiguous)
    stride_query_token, stride_query_head,
    stride_key_token, stride_key_head,
    stride_cos_token, stride_sin_token,
    # meta-parameters
    BLOCK_HEADS: tl.constexpr,  # next power of two >= H
    BLOCK_KV_HEADS: tl.constexpr,  # next power of two >= KVH
    BLOCK_HALF: tl.constexpr,  # next power of two >= D / 2
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    col_mask = cols < half_dim
    cos_row = cos_ptr + token * stride_cos_token + cols
    sin_row = sin_ptr + token * stride_sin_token + cols
    cos_first = tl.load(cos_row, mask=col_mask, other=0.0).to(tl.float32)
    cos_second = tl.load(cos_row + half_dim, mask=col_mask, other=0.0).to(tl.float32)
    sin_first = tl.load(sin_row, mask=col_mask, other=0.0).to(tl.float32)
    sin_second = tl.load(sin_row + half_dim, mask=col_mask, other=0.0).to(tl.float32)
    _rotate_heads(
        query_ptr + token * stride_query_token, cos_first, cos_second, sin_first, sin_second,
        num_heads, half_dim, stride_query_head, BLOCK_HEADS, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        key_ptr + token * stride_key_token, cos_first, cos_second, sin_first, sin_second,
        num_kv_heads, half_dim, stride_key_head, BLOCK_KV_HEADS, BLOCK_HALF,
    )  # fmt: skip


def _rope_table(name: str, table: torch.Tensor, num_tokens: int, head_dim: int, device: torch.device) -> torch.Tensor:
    """[T, 1, D] (as rope_cos_sin returns it) or [T, D] -> a [T, D] view."""
    three_dims = isinstance(table, torch.Tensor) and table.dim() == 3
    shape = (num_tokens, 1, head_dim) if three_dims else (num_tokens, head_dim)
    check_tensor("apply_rotary", name, table, shape, FLOAT_DTYPES, device)
    return table.reshape(num_tokens, head_dim) if table.dim() == 3 else table


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, H, D] and key [T, KVH, D] in place; returns (query, key) for chaining.

    cos, signed_sin: [T, 1, D] or [T, D], as worker.model.rope_cos_sin returns them (any float dtype).
    query and key may be strided views (e.g. of one fused qkv output) as long as each head vector is
    contiguous; they must not overlap each other.
    """
    check_tensor("apply_rotary", "query", query, (None, None, None), FLOAT_DTYPES)
    num_tokens, num_heads, head_dim = query.shape
    if head_dim % 2:
        raise ValueError(f"apply_rotary: query has head_dim {head_dim}, expected an even number")
    check_tensor("apply_rotary", "key", key, (num_tokens, None, head_dim), (query.dtype,), query.device)
    cos = _rope_table("cos", cos, num_tokens, head_dim, query.device)
    signed_sin = _rope_table("signed_sin", signed_sin, num_tokens, head_dim, query.device)
    if num_tokens == 0:
        return query, key
    num_kv_heads = key.shape[1]
    _rotary_kernel[(num_tokens,)](
        query, key, cos, signed_sin,
        num_heads, num_kv_heads, head_dim // 2,
        query.stride(0), query.stride(1),
        key.stride(0), key.stride(1),
        cos.stride(0), signed_sin.stride(0),
        BLOCK_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
    )  # fmt: skip
    return query, key
