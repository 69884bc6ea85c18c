"""Write this step's keys and values into their pages of the KV cache through a slot mapping.

One program per token copies its [KVH, D] key and value to slot = block * block_size + offset.
key and value may be strided views (slices of the fused qkv output), so every stride is passed in;
a negative slot marks a padding token (a captured CUDA-graph batch) and writes nothing.
Quantized pages (--kv-cache-dtype int8 / fp8_e4m3, worker.model.kv_quant): each [D] row is stored as one byte
a value and its float16 scale, absmax / 127 or / 448, computed as the torch reference does (the scale rounded
to float16 before dividing, int8 and float8 values rounded to nearest even).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.paged_shared import FLOAT_DTYPES, QUANTIZED_DTYPES, check_block_size, check_tensor, kv_scale_args

# int8: |x| / scale rounds to an integer in -127..127; float8 e4m3fn: its largest finite magnitude
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# adding and subtracting 1.5 * 2^23 leaves a float32 of magnitude < 2^22 rounded to an integer, nearest even (as
# torch.round), on the GPU and in the interpreter alike (no libdevice rint there)
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _write_kv_kernel(
    # pointers
    key_ptr,  # [T, KVH, D]
    value_ptr,  # [T, KVH, D]
    key_cache_ptr,  # [N, BLOCK_SIZE, KVH, D], int8 / float8 when QMAX > 0
    value_cache_ptr,  # [N, BLOCK_SIZE, KVH, D]
    key_scale_ptr,  # [N, BLOCK_SIZE, KVH] float16 when QMAX > 0 (else never written)
    value_scale_ptr,  # [N, BLOCK_SIZE, KVH] float16 when QMAX > 0
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
    stride_sn, stride_st,  # the scales (page, slot; the KV-head dim is dense)
    # meta-parameters
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    BLOCK_H: tl.constexpr,  # KVH padded to a power of two
    BLOCK_D: tl.constexpr,  # D padded to a power of two
    QMAX: tl.constexpr,  # 0.0: float pages, a copy; 127.0: int8 pages; 448.0: float8 e4m3 pages
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
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask, other=0.0)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask, other=0.0)
    key_dest = key_cache_ptr + page * stride_kcn + offset * stride_kct + heads * stride_kch + dims * stride_kcd
    value_dest = value_cache_ptr + page * stride_vcn + offset * stride_vct + heads * stride_vch + dims * stride_vcd
    if QMAX > 0:
        scale_offsets = page * stride_sn + offset * stride_st + tl.arange(0, BLOCK_H)
        head_valid = tl.arange(0, BLOCK_H) < num_kv_heads
        key, key_scale = _quantize_rows(key, QMAX, key_cache_ptr.dtype.element_ty)
        value, value_scale = _quantize_rows(value, QMAX, value_cache_ptr.dtype.element_ty)
        tl.store(key_scale_ptr + scale_offsets, key_scale, mask=head_valid)
        tl.store(value_scale_ptr + scale_offsets, value_scale, mask=head_valid)
    tl.store(key_dest, key, mask=mask)
    tl.store(value_dest, value, mask=mask)


@triton.jit
def _quantize_rows(x, QMAX: tl.constexpr, dtype: tl.constexpr):
    """x [H, D] (padding zeros) -> (values [H, D] of dtype, scales [H] float16), one symmetric scale a row."""
    x = x.to(tl.float32)
    scale = (tl.max(tl.abs(x), 1) / QMAX).to(tl.float16)
    stored = scale.to(tl.float32)
    inverse = tl.where(stored > 0, 1.0 / tl.where(stored > 0, stored, 1.0), 0.0)  # an all-zero row stays 0
    scaled = tl.minimum(tl.maximum(x * inverse[:, None], -QMAX), QMAX)
    if QMAX == 127.0:
        scaled = (scaled + _ROUND_MAGIC) - _ROUND_MAGIC
    else:
        scaled = _round_to_e4m3(scaled)
    return scaled.to(dtype), scale


@triton.jit
def _round_to_e4m3(x):
    """x (|x| <= 448) rounded to the nearest float8 e4m3fn value, ties to even, still float32, so the cast after it
    is exact. Why not the cast alone: the Triton interpreter's float32 -> float8 conversion drops the carry when
    the mantissa rounds up into the next power of two (126.8 became 64, not 128: 2% of a random row's values), and
    rounding here gives torch's result on every backend. The grid step is 2^(exponent - 3) (3 mantissa bits), and
    2^-9 below 2^-6 (the subnormals)."""
    exponent = (x.to(tl.int32, bitcast=True) >> 23) & 0xFF
    step = (tl.maximum(exponent - 3, 127 - 9) << 23).to(tl.float32, bitcast=True)
    return ((x / step + _ROUND_MAGIC) - _ROUND_MAGIC) * step


def write_kv(
    key: torch.Tensor,  # [T, KVH, D], any strides
    value: torch.Tensor,  # [T, KVH, D], any strides
    key_cache: torch.Tensor,  # [N, block_size, KVH, D], written in place
    value_cache: torch.Tensor,  # [N, block_size, KVH, D], written in place
    slot_mapping: torch.Tensor,  # [T] int64 (int32 also taken): block * block_size + offset; < 0 skips
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8 / float8 pages' scales [N, block_size, KVH]
) -> None:
    """key_cache[slot // block_size, slot % block_size] = key[t] (and the same for value) for every
    token t whose slot is >= 0, quantized with its scale where kv_scales are given. Slots must lie inside
    the cache; they are not checked (no host sync)."""
    device = key_cache.device
    quantized = kv_scales is not None
    check_tensor("key_cache", key_cache, (None, None, None, None), QUANTIZED_DTYPES if quantized else FLOAT_DTYPES,
                 device)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    check_block_size("key_cache", block_size)
    check_tensor("value_cache", value_cache, tuple(key_cache.shape), (key_cache.dtype,), device, dtype_from="key_cache")
    value_dtypes, dtype_from = (FLOAT_DTYPES, None) if quantized else ((key_cache.dtype,), "key_cache")
    check_tensor("key", key, (None, num_kv_heads, head_dim), value_dtypes, device, dtype_from=dtype_from)
    num_tokens = key.shape[0]
    check_tensor("value", value, (num_tokens, num_kv_heads, head_dim), (key.dtype,), device, dtype_from="key")
    check_tensor("slot_mapping", slot_mapping, (num_tokens,), (torch.int64, torch.int32), device)
    key_scales, value_scales, *scale_strides = kv_scale_args(key_cache, kv_scales)
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, key_scales, value_scales, slot_mapping,
        num_kv_heads, head_dim,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        slot_mapping.stride(0),
        *scale_strides,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        QMAX=QMAX.get(key_cache.dtype, 0.0),
    )
