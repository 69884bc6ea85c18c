"""Paged decode attention: one query token per request against its pages of the KV cache.

Flash-decoding: each program takes one request, one KV head and one split of the context, loads the
G = H / KVH query heads that share that KV head as the rows of one tile (so K/V are read once per
group, not once per query head), and runs an online softmax over BLOCK_N keys at a time, gathering
each key's page through the block table. With more than one split, a second kernel merges the
splits' partial outputs by their log-sum-exp. The number of splits depends only on shapes (batch,
heads, block-table width), never on context_lens values, so a CUDA graph can capture the launch; each
program cuts its own request's context into that many pieces. Attention sinks (gpt-oss) join the first
split's softmax as its starting state (running max the sink, running sum 1), so the merge counts each once.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from worker.kernels.checks import output_tensor
from worker.kernels.paged_shared import (LOG2_E, attend_keys, attend_keys_meta, check_query_and_caches,
                                         check_tensor, check_window_and_softcap, kv_scale_args,
                                         paged_strides, sink_args, sink_start)

BLOCK_N = 64  # keys per inner step
MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the parallelism it adds


@triton.jit
def _paged_decode_kernel(
    # pointers
    query_ptr,  # [B, H, D]
    key_cache_ptr,  # [N, BLOCK_SIZE, KVH, D]
    value_cache_ptr,  # [N, BLOCK_SIZE, KVH, D], int8 / float8 when KV_QUANT
    key_scale_ptr, value_scale_ptr,  # each [N, BLOCK_SIZE, KVH] float16 when KV_QUANT (else never read)
    block_tables_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32
    sinks_ptr,  # [H] float: each query head's attention sink (HAS_SINKS; else never read)
    out_ptr,  # NUM_SPLITS == 1: [B, H, D] in the query dtype; else [B, H, NUM_SPLITS, D] float32
    lse_ptr,  # [B, H, NUM_SPLITS] float32, base-2 log-sum-exp of each split (unused if NUM_SPLITS == 1)
    # sizes
    scale_log2,  # softmax scale * log2(e): the softmax runs in base 2
    num_queries_per_kv,  # G = H // KVH
    window,  # sliding window: only the last `window` keys count; 0: full context
    softcap,  # attention logit soft-cap; 0.0: none
    # strides (the last dim of query, caches and out is dense)
    # paged_strides(): query (token, head), both caches (page, slot, KV head), block tables, context lengths
    stride_qb, stride_qh, stride_cn, stride_ct, stride_ch, stride_tb, stride_tm, stride_cb,
    stride_sn, stride_st,  # the scales (page, slot; the KV-head dim is dense)
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    # meta-parameters
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,  # G padded to a power of two >= 16 (tl.dot's smallest tile)
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,  # attend_keys_meta(), for attend_keys
    KV_QUANT: tl.constexpr,  # attend_keys_meta(): quantized pages, dequantized as read
    HAS_SINKS: tl.constexpr,
):
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + request * stride_cb)
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(context_len, start + split_len)
    # with a window the splits still cut the whole context (shape-only, for graphs); skip what is outside
    start = tl.where(window > 0, tl.maximum(start, context_len - window), start)

    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, HEAD_DIM)
    row_valid = rows < num_queries_per_kv
    heads = kv_head * num_queries_per_kv + rows
    q = tl.load(
        query_ptr + request * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )  # [BLOCK_G, D]

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    if HAS_SINKS:  # in the first split only: the merge adds the splits' sums, and the sink counts once
        m_i, l_i = sink_start(sinks_ptr, heads, row_valid, m_i, l_i, split == 0)
    table_row = block_tables_ptr + request * stride_tb
    for block_start in range(start, end, BLOCK_N):
        positions = block_start + tl.arange(0, BLOCK_N)
        key_valid = positions < end  # every step holds at least one valid key, so the max stays finite
        m_i, l_i, acc = attend_keys(
            q, m_i, l_i, acc, positions, key_valid, key_valid[None, :], table_row, stride_tm, kv_head, dims,
            scale_log2, softcap, key_cache_ptr, value_cache_ptr, stride_cn, stride_ct, stride_ch,
            key_scale_ptr, value_scale_ptr, stride_sn, stride_st, BLOCK_SIZE, PRECISION, UPCAST, SOFTCAP, KV_QUANT)

    # a split past the end of a short context saw no key: l_i == 0, its output is 0, its lse -inf
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_offsets = request * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    if NUM_SPLITS > 1:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + request * stride_lb + heads * stride_lh + split, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    # pointers
    partial_ptr,  # [B, H, NUM_SPLITS, D] float32, each split's normalised output
    lse_ptr,  # [B, H, NUM_SPLITS] float32
    out_ptr,  # [B, H, D]
    # strides
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    # meta-parameters
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # NUM_SPLITS padded to a power of two
    HEAD_DIM: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, HEAD_DIM)
    split_valid = splits < NUM_SPLITS
    lse = tl.load(lse_ptr + request * stride_lb + head * stride_lh + splits, mask=split_valid, other=float("-inf"))
    # all -inf only for context_len 0 (a padded row of a captured batch): its output is then 0, not NaN
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)  # [BLOCK_S]
    partial = tl.load(
        partial_ptr + request * stride_pb + head * stride_ph + splits[:, None] * stride_ps + dims[None, :],
        mask=split_valid[:, None],
        other=0.0,
    )  # [BLOCK_S, D]
    weight_sum = tl.sum(weights, 0)
    out = tl.sum(partial * weights[:, None], 0) / tl.where(weight_sum > 0, weight_sum, 1.0)
    tl.store(out_ptr + request * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough programs to fill the GPU twice over, at most one split per MIN_SPLIT_TOKENS of the block
    table's capacity (max_context), at most 16; 1 off CUDA (the interpreter runs programs one after
    another, so splitting only adds work there)."""
    if device.type != "cuda":
        return 1
    device_index = device.index if device.index is not None else torch.cuda.current_device()
    wanted = triton.cdiv(2 * _num_sms(device_index), batch * num_kv_heads)
    return max(1, min(wanted, max_context // MIN_SPLIT_TOKENS, 16))


def paged_decode_attention(
    query: torch.Tensor,  # [B, H, D]
    key_cache: torch.Tensor,  # [N, block_size, KVH, D]
    value_cache: torch.Tensor,  # [N, block_size, KVH, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32; keys 0..context_len-1 (this token's included) are in the cache
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, D], query's dtype
    *,
    num_splits: int | None = None,  # None: default_num_splits(); the tests force it to cover the merge
    window: int | None = None,  # sliding window: only the last `window` keys; None: the whole context
    softcap: float | None = None,  # attention logit soft-cap (gemma2); None: none
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8 / float8 pages' scales [N, block_size, KVH]
    sinks: torch.Tensor | None = None,  # [H] attention sinks (gpt-oss): one more logit in each softmax, no value
) -> torch.Tensor:
    """Returns out [B, H, D]: softmax(scale * q . k) . v over each request's context_len keys (the
    last `window` of them when set); a row with context_len 0 (padding in a captured batch) gets zeros."""
    device = query.device
    window, softcap = check_window_and_softcap(window, softcap)
    block_size, num_kv_heads = check_query_and_caches(query, key_cache, value_cache, kv_scales)
    key_scales, value_scales, *scale_strides = kv_scale_args(key_cache, kv_scales)
    sinks, has_sinks = sink_args(sinks, query)
    batch, num_heads, head_dim = query.shape
    check_tensor("block_tables", block_tables, (batch, None), (torch.int32,), device)
    check_tensor("context_lens", context_lens, (batch,), (torch.int32,), device)
    out = output_tensor("", "out", out, tuple(query.shape), query, dtype_from="query")
    if batch == 0:
        return out

    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, max_context, device)
    if num_splits < 1:
        raise ValueError(f"num_splits is {num_splits}, expected >= 1")
    queries_per_kv = num_heads // num_kv_heads
    if num_splits == 1:
        partial, lse = out, out  # the kernel writes straight into out; lse is unused
        partial_strides = (out.stride(0), out.stride(1), 0)
    else:
        partial = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=device)
        partial_strides = partial.stride()[:3]

    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        query, key_cache, value_cache, key_scales, value_scales, block_tables, context_lens, sinks, partial, lse,
        scale * LOG2_E, queries_per_kv, window, softcap,
        *paged_strides(query, key_cache, block_tables, context_lens), *scale_strides,
        *partial_strides,
        lse.stride(0), lse.stride(1),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_splits,
        **attend_keys_meta(query.dtype, device, softcap, kv_scales),
        HAS_SINKS=has_sinks,
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            partial, lse, out,
            *partial.stride()[:3],
            lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
        )
    return out
