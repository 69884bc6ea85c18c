"""Write this step's keys and values into their pages of the KV cache through a slot mapping.

One program per token copies its [KVH, D] key and value to slot = block * block_size + offset.
key and value may be strided views (slices of the fused qkv output), so every stride is passed in;
a negative slot marks a padding token (a captured CUDA-graph batch) and writes nothing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.paged_shared import FLOAT_DTYPES, check_block_size, check_tensor


@triton.jit
def _write_kv_kernel(
    # pointers
    key_ptr,  # [T, KVH, D]
    value_ptr,  # [T, KVH, D]
    key_cache_ptr,  # [N, BLOCK_SIZE, KVH, D]
    value_cache_ptr,  # [N, BLOCK_SIZE, KVH, D]
    slot_mapping_ptr,  # [T] int64 (or int32); < 0: skip
    # sizes
    num_kv_heads,
    head_dim,
    # strides
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcn, stride_kct, stride_kch, stride_kcd,
    stride_vcn, stride_vct, stride_vch, stride_vcd,
    stride_slot,
    # meta-parameters
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    BLOCK_H: tl.constexpr,  # KVH padded to a power of two
    BLOCK_D: tl.constexpr,  # D padded to a power of two
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token * stride_slot).to(tl.int64)
    if slot < 0:
        return
    page = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    key_dest = key_cache_ptr + page * stride_kcn + offset * stride_kct + heads * stride_kch + dims * stride_kcd
    value_dest = value_cache_ptr + page * stride_vcn + offset * stride_vct + heads * stride_vch + dims * stride_vcd
    tl.store(key_dest, key, mask=mask)
    tl.store(value_dest, value, mask=mask)


def write_kv(
    key: torch.Tensor,  # [T, KVH, D], any strides
    value: torch.Tensor,  # [T, KVH, D], any strides
    key_cache: torch.Tensor,  # [N, block_size, KVH, D], written in place
    value_cache: torch.Tensor,  # [N, block_size, KVH, D], written in place
    slot_mapping: torch.Tensor,  # [T] int64 (int32 also taken): block * block_size + offset; < 0 skips
) -> None:
    """key_cache[slot // block_size, slot % block_size] = key[t] (and the same for value) for every
    token t whose slot is >= 0. Slots must lie inside the cache; they are not checked (no host sync)."""
    device = key_cache.device
    check_tensor("key_cache", key_cache, (None, None, None, None), FLOAT_DTYPES, device)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    check_block_size("key_cache", block_size)
    check_tensor("value_cache", value_cache, tuple(key_cache.shape), (key_cache.dtype,), device, dtype_from="key_cache")
    check_tensor("key", key, (None, num_kv_heads, head_dim), (key_cache.dtype,), device, dtype_from="key_cache")
    num_tokens = key.shape[0]
    check_tensor("value", value, (num_tokens, num_kv_heads, head_dim), (key_cache.dtype,), device, dtype_from="key_cache")
    check_tensor("slot_mapping", slot_mapping, (num_tokens,), (torch.int64, torch.int32), device)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        num_kv_heads, head_dim,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        slot_mapping.stride(0),
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
