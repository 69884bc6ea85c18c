"""Quantized KV pages (--kv-cache-dtype int8 | fp8_e4m3): the format, and its plain-torch quantize / dequantize.

Each K (and V) row of one token and one KV head, D values, is stored as D one-byte values and one float16 scale:

    key_cache   [num_blocks, block_size, KVH, D]  int8 (round(x / s), in -127..127) or float8_e4m3fn (x / s)
    key_scales  [num_blocks, block_size, KVH]     float16: s = absmax(row) / 127 (int8) or / 448 (fp8 e4m3)
    value_cache, value_scales                     the same for V

Why a scale per (token, head) and not per page: a page is written one token at a time (decode writes one slot
a step), so a page's scale would have to be fixed before its later tokens are seen, and one outlier token
would coarsen every other token of the page; a per-row scale is final when the row is written and never
rewritten. Why float16 and not float32: at head_dim 64 a row is then 64 + 2 bytes against bfloat16's 128
(1.94x the tokens per byte; head_dim 128: 1.97x), where a float32 scale would give 1.88x. float16, not
bfloat16: its 11-bit mantissa keeps the scale itself within 0.05% (bfloat16's 8 bits: 0.4%), and K/V row
maxima sit far inside its range (6e-8 .. 65504 times 127 or 448).
Symmetric: keys and values after RoPE are centred on zero, and no zero point keeps dequantization one multiply.
The compiled CPU ops (worker/csrc/decoder_ops.cpp) implement the same arithmetic; these functions are the
reference they are tested against.
"""
from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16
# --kv-cache-dtype -> (storage dtype, the largest stored magnitude: absmax maps to it)
QUANTIZED_KV = {"int8": (torch.int8, 127.0), "fp8_e4m3": (torch.float8_e4m3fn, 448.0)}
_QMAX = {dtype: qmax for dtype, qmax in QUANTIZED_KV.values()}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pages' storage dtype for --kv-cache-dtype name (auto: the model dtype)."""
    if name == "auto":
        return model_dtype
    if name not in QUANTIZED_KV:
        raise ValueError(f"kv_cache_dtype={name!r} is not one of {['auto', *QUANTIZED_KV]}")
    return QUANTIZED_KV[name][0]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (values [..., D] of dtype, scales [...] float16), one scale per row of D."""
    qmax = _QMAX[dtype]
    absmax = x.float().abs().amax(dim=-1)
    # the scale as stored (float16) is the one divided by, so dequantize(quantize(x)) errs by rounding only
    scales = (absmax / qmax).to(SCALE_DTYPE)
    inverse = torch.where(scales > 0, 1.0 / scales.float(), torch.zeros_like(absmax))  # an all-zero row stays 0
    scaled = (x.float() * inverse[..., None]).clamp(-qmax, qmax)
    values = scaled.round().to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return values, scales


def dequantize_rows(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(values [..., D], scales [...]) -> [..., D] in dtype: values * scale, in float32 then rounded once."""
    return (values.float() * scales.float()[..., None]).to(dtype)


def write_quantized(cache: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache [num_blocks, block_size, KVH, D], scales [num_blocks, block_size, KVH]: rows [T, KVH, D] quantized
    into the slots slot_mapping [T] names."""
    values, row_scales = quantize_rows(rows, cache.dtype)
    # index_copy_ has no float8 kernel on CPU: copy the bytes
    cache.view(torch.uint8).view(-1, *rows.shape[1:]).index_copy_(0, slot_mapping, values.view(torch.uint8))
    scales.view(-1, rows.shape[1]).index_copy_(0, slot_mapping, row_scales)
