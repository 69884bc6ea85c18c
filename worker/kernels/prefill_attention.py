"""Varlen prefill / extend attention over the paged KV cache, causal, with an already-computed prefix.

The packed query holds R requests back to back (query_start_loc); request r's chunk of query_len
tokens is the tail of its context_len keys, all of which (this chunk's included) are already in the
cache, so its i-th token sits at position context_len - query_len + i and attends to keys 0..that.

Each program takes BLOCK_Q tokens of one request and one KV head; the rows of its query tile are
(token, query head of the group) pairs, BLOCK_Q * G of them, so the group's K/V tiles are loaded once
and a decode row (query_len 1) still fills G rows. The grid is T // BLOCK_Q + R tiles, an upper
bound that needs no host sync (request r's tiles start at tile query_start_loc[r] // BLOCK_Q + r);
each program finds its request by binary search and spare programs exit at once. Attention sinks
(gpt-oss) are each row's starting state: running max the sink, running sum 1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.checks import output_tensor
from worker.kernels.paged_shared import (LOG2_E, attend_keys, attend_keys_meta, check_query_and_caches,
                                         check_tensor, check_window_and_softcap, kv_scale_args,
                                         paged_strides, sink_args, sink_start)


def _tiles(dtype: torch.dtype, head_dim: int, queries_per_kv: int) -> tuple[int, int, int]:
    """(BLOCK_M query rows, BLOCK_N keys, num_warps), from sm_90 compiles (ptxas -v, no GPU run):
    16-bit 64 x 64 at D=128 takes 195 registers with 4 warps, 136 with 8, no spills; float32 (full
    precision products) spills at 64 x 64 even with 8 warps, and 32 x 32 with 4 warps does not."""
    block_m, block_n = (32, 32) if dtype == torch.float32 else (64, 64)
    num_warps = 8 if dtype != torch.float32 and head_dim >= 128 else 4
    return max(block_m, triton.next_power_of_2(queries_per_kv)), block_n, num_warps


@triton.jit
def _find_request(query_start_loc_ptr, num_requests, tile, BLOCK_Q: tl.constexpr):
    """The last request r whose first tile, query_start_loc[r] // BLOCK_Q + r, is <= tile."""
    low = num_requests * 0
    high = num_requests - 1
    while low < high:
        mid = (low + high + 1) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        low = tl.where(first_tile <= tile, mid, low)
        high = tl.where(first_tile <= tile, high, mid - 1)
    return low


# num_requests == 1 would otherwise become a compile-time constant, and the binary search a Python int
@triton.jit(do_not_specialize=["num_requests"])
def _prefill_kernel(
    # pointers
    query_ptr,  # [T, H, D]
    key_cache_ptr,  # [N, BLOCK_SIZE, KVH, D]
    value_cache_ptr,  # [N, BLOCK_SIZE, KVH, D], int8 / float8 when KV_QUANT
    key_scale_ptr, value_scale_ptr,  # each [N, BLOCK_SIZE, KVH] float16 when KV_QUANT (else never read)
    block_tables_ptr,  # [R, max_blocks] int32
    query_start_loc_ptr,  # [R + 1] int32, contiguous
    context_lens_ptr,  # [R] int32
    sinks_ptr,  # [H] float: each query head's attention sink (HAS_SINKS; else never read)
    out_ptr,  # [T, H, D]
    # sizes
    scale_log2,  # softmax scale * log2(e): the softmax runs in base 2
    num_requests,  # R
    window,  # sliding window: a token sees keys at positions > its own - window; 0: full context
    softcap,  # attention logit soft-cap; 0.0: none
    # strides (the last dim of query, caches and out is dense)
    # paged_strides(): query (token, head), both caches (page, slot, KV head), block tables, context lengths
    stride_qt, stride_qh, stride_cn, stride_ct, stride_ch, stride_tb, stride_tm, stride_cr,
    stride_sn, stride_st,  # the scales (page, slot; the KV-head dim is dense)
    stride_ot, stride_oh,
    # meta-parameters
    BLOCK_SIZE: tl.constexpr,  # tokens per page
    HEAD_DIM: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,  # G = H // KVH
    BLOCK_Q: tl.constexpr,  # tokens per tile: BLOCK_M // G
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr,  # attend_keys_meta(), for attend_keys
    KV_QUANT: tl.constexpr,  # attend_keys_meta(): quantized pages, dequantized as read
    HAS_SINKS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    request = _find_request(query_start_loc_ptr, num_requests, tile, BLOCK_Q)
    query_start = tl.load(query_start_loc_ptr + request)
    query_len = tl.load(query_start_loc_ptr + request + 1) - query_start
    first_token = (tile - (query_start // BLOCK_Q + request)) * BLOCK_Q  # within the request's chunk
    if first_token >= query_len:
        return
    context_len = tl.load(context_lens_ptr + request * stride_cr)
    prefix_len = context_len - query_len

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    tokens = first_token + rows // QUERIES_PER_KV  # [BLOCK_M]
    heads = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (tokens < query_len)
    query_rows = (query_start + tokens).to(tl.int64)
    q = tl.load(
        query_ptr + query_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )  # [BLOCK_M, D]
    query_positions = prefix_len + tokens  # [BLOCK_M]
    # keys up to the tile's last query position; row r's own causal limit is applied per score
    key_end = prefix_len + tl.minimum(first_token + BLOCK_Q, query_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if HAS_SINKS:
        m_i, l_i = sink_start(sinks_ptr, heads, row_valid, m_i, l_i, row_valid)
    table_row = block_tables_ptr + request.to(tl.int64) * stride_tb
    # with a window, nothing before the window of the tile's first token
    key_start = tl.where(window > 0, tl.maximum(prefix_len + first_token - window + 1, 0), 0)
    for block_start in range(key_start, key_end, BLOCK_N):
        positions = block_start + tl.arange(0, BLOCK_N)
        key_valid = positions < key_end
        visible = key_valid[None, :] & (positions[None, :] <= query_positions[:, None])
        visible = visible & ((window == 0) | (positions[None, :] > query_positions[:, None] - window))
        m_i, l_i, acc = attend_keys(
            q, m_i, l_i, acc, positions, key_valid, visible, table_row, stride_tm, kv_head, dims,
            scale_log2, softcap, key_cache_ptr, value_cache_ptr, stride_cn, stride_ct, stride_ch,
            key_scale_ptr, value_scale_ptr, stride_sn, stride_st, BLOCK_SIZE, PRECISION, UPCAST, SOFTCAP, KV_QUANT)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only on rows that are not stored
    tl.store(
        out_ptr + query_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


def paged_prefill_attention(
    query: torch.Tensor,  # [T, H, D], R requests packed back to back
    key_cache: torch.Tensor,  # [N, block_size, KVH, D]
    value_cache: torch.Tensor,  # [N, block_size, KVH, D]
    block_tables: torch.Tensor,  # [R, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32: request r's tokens are rows [loc[r], loc[r + 1])
    context_lens: torch.Tensor,  # [R] int32: prefix already cached + this chunk; >= the chunk's length
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D], query's dtype
    *,
    window: int | None = None,  # sliding window (mistral, gemma local layers); None: full context
    softcap: float | None = None,  # attention logit soft-cap (gemma2); None: none
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # int8 / float8 pages' scales [N, block_size, KVH]
    sinks: torch.Tensor | None = None,  # [H] attention sinks (gpt-oss): one more logit in each softmax, no value
) -> torch.Tensor:
    """Returns out [T, H, D]: each query token attends causally to its request's cached keys (the last
    `window` of them when set). Rows past query_start_loc[R] (padding) are left as they were in out
    (uninitialised if out is None)."""
    device = query.device
    window, softcap = check_window_and_softcap(window, softcap)
    block_size, num_kv_heads = check_query_and_caches(query, key_cache, value_cache, kv_scales)
    key_scales, value_scales, *scale_strides = kv_scale_args(key_cache, kv_scales)
    sinks, has_sinks = sink_args(sinks, query)
    num_tokens, num_heads, head_dim = query.shape
    check_tensor("query_start_loc", query_start_loc, (None,), (torch.int32,), device)
    num_requests = query_start_loc.shape[0] - 1
    if num_requests < 0:
        raise ValueError("query_start_loc has shape [0], expected [R + 1] with R >= 0")
    if query_start_loc.stride(0) != 1:
        raise ValueError(f"query_start_loc has strides {query_start_loc.stride()}, expected a contiguous tensor")
    check_tensor("block_tables", block_tables, (num_requests, None), (torch.int32,), device)
    check_tensor("context_lens", context_lens, (num_requests,), (torch.int32,), device)
    out = output_tensor("", "out", out, tuple(query.shape), query, dtype_from="query")
    if num_tokens == 0 or num_requests == 0:
        return out

    queries_per_kv = num_heads // num_kv_heads
    block_m, block_n, num_warps = _tiles(query.dtype, head_dim, queries_per_kv)
    block_q = block_m // queries_per_kv  # tokens per tile; a group of heads never splits across tiles
    _prefill_kernel[(num_tokens // block_q + num_requests, num_kv_heads)](
        query, key_cache, value_cache, key_scales, value_scales, block_tables, query_start_loc, context_lens, sinks,
        out,
        scale * LOG2_E, num_requests, window, softcap,
        *paged_strides(query, key_cache, block_tables, context_lens), *scale_strides,
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **attend_keys_meta(query.dtype, device, softcap, kv_scales),
        HAS_SINKS=has_sinks,
        num_warps=num_warps,
    )
    return out
