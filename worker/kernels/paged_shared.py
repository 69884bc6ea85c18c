"""Pieces shared by the paged-attention and KV-write kernels: the wrappers' argument checks (each
raises ValueError naming the argument, what it got and what was expected), the tl.dot helper, and the
quantized pages' arguments (--kv-cache-dtype int8 / fp8_e4m3: worker.model.kv_quant's format, one byte a
value and a float16 scale per token and KV head, dequantized here as the keys and values are read)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels import checks

FLOAT_DTYPES = checks.FLOAT_DTYPES
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)  # worker.model.kv_quant.QUANTIZED_KV's storage dtypes


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    shape: tuple[int | None, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    unit_last_stride: bool = False,
    dtype_from: str | None = None,
) -> None:
    """worker.kernels.checks.check_tensor without the function prefix (the attention wrappers' messages
    name only the argument); unit_last_stride: the last dim must be dense."""
    checks.check_tensor("", name, tensor, shape, dtypes, device, unit_last_stride, dtype_from)


def check_head_dim(name: str, head_dim: int) -> None:
    # tl.arange needs a power of two, and tl.dot needs at least 16 along the reduced dim
    if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
        raise ValueError(f"{name} has head_dim {head_dim}, expected a power of two in [16, 256]")


def check_block_size(name: str, block_size: int) -> None:
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"{name} has block_size {block_size}, expected a power of two")


def check_kv_heads(num_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"query has {num_heads} heads, expected a multiple of the caches' {num_kv_heads} KV heads")


def kv_scale_args(key_cache: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None
                  ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The kernels' scale arguments: (key_scales, value_scales, page stride, slot stride), the scales
    [N, block_size, KVH] float16 with a dense KV-head dim; for float pages (kv_scales None) the caches stand
    in as never-read pointers."""
    if kv_scales is None:
        return key_cache, key_cache, 0, 0
    for name, scales in zip(("key_scales", "value_scales"), kv_scales):
        check_tensor(name, scales, tuple(key_cache.shape[:3]), (torch.float16,), key_cache.device, True)
    if kv_scales[1].stride() != kv_scales[0].stride():
        raise ValueError(f"value_scales has strides {list(kv_scales[1].stride())}, expected key_scales' "
                         f"{list(kv_scales[0].stride())}")
    return kv_scales[0], kv_scales[1], kv_scales[0].stride(0), kv_scales[0].stride(1)


def cache_dtypes(value_dtype: torch.dtype, kv_scales: object) -> tuple[tuple[torch.dtype, ...], str | None]:
    """(the caches' allowed dtypes, the argument named in a mismatch): the values' dtype for float pages, int8 or
    float8_e4m3fn where scales come with them."""
    if kv_scales is None:
        return (value_dtype,), "query"
    return QUANTIZED_DTYPES, None


def check_query_and_caches(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [N, block_size, KVH, D]
    value_cache: torch.Tensor,  # [N, block_size, KVH, D]
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # quantized pages' scales
) -> tuple[int, int]:
    """Checks shared by both attention wrappers; returns (block_size, KVH)."""
    device = query.device
    check_tensor("query", query, (None, None, None), FLOAT_DTYPES, device, unit_last_stride=True)
    num_heads, head_dim = query.shape[1:]
    cache_shape = (None, None, None, head_dim)
    dtypes, dtype_from = cache_dtypes(query.dtype, kv_scales)
    check_tensor("key_cache", key_cache, cache_shape, dtypes, device, True, dtype_from=dtype_from)
    check_tensor("value_cache", value_cache, tuple(key_cache.shape), (key_cache.dtype,), device, True,
                 dtype_from="key_cache")
    # the kernels read both caches through one set of strides (one layout, as the KV cache allocates them)
    if value_cache.stride() != key_cache.stride():
        raise ValueError(f"value_cache has strides {list(value_cache.stride())}, expected key_cache's "
                         f"{list(key_cache.stride())}")
    _, block_size, num_kv_heads, _ = key_cache.shape
    check_head_dim("query", head_dim)
    check_block_size("key_cache", block_size)
    check_kv_heads(num_heads, num_kv_heads)
    return block_size, num_kv_heads


def dot_upcast(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether tl.dot operands must be float32: the Triton interpreter (any non-CUDA device) multiplies
    bfloat16 as the raw uint16 bit patterns it stores them in, so there the kernels upcast first."""
    return dtype == torch.bfloat16 and device.type != "cuda"


def dot_precision(dtype: torch.dtype) -> str:
    # float32 inputs: full-precision products (tf32 would miss the float32 tolerance); others ignore it
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_strides(query: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor) -> tuple[int, ...]:
    """The strides both attention kernels take first, in their signatures' order: query (token, head),
    the caches (page, slot, KV head; check_query_and_caches holds the value cache's equal to these),
    block_tables (row, column), context_lens."""
    return (*query.stride()[:2], *key_cache.stride()[:3], *block_tables.stride(), context_lens.stride(0))


def attend_keys_meta(dtype: torch.dtype, device: torch.device, softcap: float, kv_scales: object = None
                     ) -> dict[str, object]:
    """The meta-parameters both attention kernels pass on to attend_keys."""
    return {"PRECISION": dot_precision(dtype), "UPCAST": dot_upcast(dtype, device), "SOFTCAP": softcap > 0,
            "KV_QUANT": kv_scales is not None}


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with float32 accumulation; PRECISION from dot_precision(), UPCAST from dot_upcast()."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


LOG2_E = 1.4426950408889634  # the kernels' softmax runs in base 2: the launchers pass scale * LOG2_E
# @triton.jit code may read a global only when it is a constexpr instance; the interpreter lets a plain
# float through, the compiler does not (a NameError on the first real GPU)
_LOG2_E = tl.constexpr(LOG2_E)


def sink_args(sinks: torch.Tensor | None, query: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The kernels' sink arguments: (the pointer, HAS_SINKS); sinks [H] float (gpt-oss), or None, when the query
    stands in as a never-read pointer."""
    if sinks is None:
        return query, False
    check_tensor("sinks", sinks, (query.shape[1],), FLOAT_DTYPES, query.device)
    return sinks, True


@triton.jit
def sink_start(sinks_ptr, heads, row_valid, m_i, l_i, count):
    """The online softmax's state with an attention sink (gpt-oss: one logit per query head in the denominator,
    no value) already in it: running max the sink (base 2), running sum 1, where count holds; else as it was."""
    sink = tl.load(sinks_ptr + heads, mask=row_valid, other=0.0).to(tl.float32) * _LOG2_E
    return tl.where(count, sink, m_i), tl.where(count, 1.0, l_i)


def check_window_and_softcap(window: int | None, softcap: float | None) -> tuple[int, float]:
    """The kernels' encoding: window 0 and softcap 0.0 mean none."""
    if window is not None and window < 1:
        raise ValueError(f"window is {window}, expected None or >= 1")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap is {softcap}, expected None or > 0")
    return window or 0, softcap or 0.0


@triton.jit
def _tanh(x):
    # 2 / (1 + e^-2x) - 1: exact at both ends in float32 (e^-2x over/underflows to inf / 0)
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def attend_keys(
    q, m_i, l_i, acc,  # [M, D] queries; running max [M], running sum [M], unnormalised output [M, D]
    positions, key_valid, visible,  # [N] key positions, [N] in range, [M, N] which scores count
    table_row, stride_tm, kv_head, dims, scale_log2,
    softcap,  # attention logit soft-cap (gemma2): scores = softcap * tanh(scores / softcap); used if SOFTCAP
    key_cache_ptr, value_cache_ptr, stride_cn, stride_ct, stride_ch,  # the caches share one layout
    key_scale_ptr, value_scale_ptr, stride_sn, stride_st,  # quantized pages' scales [N, BLOCK_SIZE, KVH] (KV_QUANT)
    BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,
    KV_QUANT: tl.constexpr,  # the pages hold int8 / float8 values: each row times its scale, in q's dtype
):
    """One online-softmax step (base 2) over N keys read through a request's block table: both
    attention kernels' inner loop. A row that has seen no key yet (its running max still -inf, as
    happens before a sliding window starts) keeps a zero state; rows that see none of these keys keep
    their state."""
    page = tl.load(table_row + (positions // BLOCK_SIZE) * stride_tm, mask=key_valid, other=0).to(tl.int64)
    offset = positions % BLOCK_SIZE
    slots = page[:, None] * stride_cn + offset[:, None] * stride_ct + kv_head * stride_ch + dims[None, :]  # [N, D]
    scale_slots = page * stride_sn + offset * stride_st + kv_head  # [N], read only when KV_QUANT
    k = tl.load(
        key_cache_ptr + slots,
        mask=key_valid[:, None],
        other=0.0,
    )  # [N, D]
    if KV_QUANT:  # dequantized as worker.model.kv_quant.dequantize_rows: value * scale in float32, then q's dtype
        k_scale = tl.load(key_scale_ptr + scale_slots, mask=key_valid, other=0.0).to(tl.float32)
        k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
    scores = dot(q, tl.trans(k), PRECISION, UPCAST)  # [M, N]
    if SOFTCAP:  # cap the scaled score, then go to base 2
        scores = softcap * _tanh(scores * (scale_log2 / _LOG2_E) / softcap) * _LOG2_E
    else:
        scores = scores * scale_log2
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: exp2(-inf - 0) = 0, not NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        value_cache_ptr + slots,
        mask=key_valid[:, None],
        other=0.0,
    )  # [N, D]
    if KV_QUANT:
        v_scale = tl.load(value_scale_ptr + scale_slots, mask=key_valid, other=0.0).to(tl.float32)
        v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i, acc
