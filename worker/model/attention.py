"""Attention over the paged KV cache for one packed step that mixes prefill chunks and decode tokens.

The metadata is built once per step from the plan and shared by every layer, so the layer loop does
no Python work per request for decode rows and no host syncs (.item()/.tolist()):
  - decode rows (one query token each) are batched: sorted by context length and cut into a few
    groups whose gathered K/V fit a cache-sized budget; per group and layer, one gather of their
    blocks, padded to the group's longest context with a mask, and one scaled_dot_product_attention;
  - prefill chunks run one SDPA call each: causal over themselves plus the whole prefix already in
    the cache (from the prefix cache or earlier chunks).
Padding exists only inside the decode gather; the token batch itself is packed (invariant 5).
With the compiled ops (worker.paths.fused_ops, plan_attention(in_place=True)) the decode rows instead go to one
call that reads K/V from the cache pages in place: no gather, no padding, no mask (PagedDecode).
It is built in two halves: plan_attention() (host lists: slots, groups; plain Python, so the worker
can build it on its RPC thread) and attention_metadata() (the tensors, on the compute thread).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from worker.model.kv_quant import dequantize_rows, write_quantized
from worker.step_batch import RequestSpan

# a layer's K/V scales when its pages are quantized (worker.model.kv_quant): (key_scales, value_scales), each
# [num_blocks, block_size, KVH] float16; None: the pages hold floats
KVScales = tuple[torch.Tensor, torch.Tensor] | None


# Gathered K+V per decode group. Measured on CPU (32 requests, 384 tokens of context): one 19 MB
# gather + SDPA per layer took 5.1 ms, two groups of ~9 MB 3.7 ms, as the group stays in cache.
DECODE_GROUP_BYTES = 8 * 2**20


class GatherWorkspace:
    """Output buffers for the decode gather, reused by every layer, group and step.

    A fresh multi-MB tensor per layer costs more in page faults than the copy itself (the allocator
    hands large blocks back to the OS on free), so the gathered K/V always land in these buffers.
    """

    def __init__(
        self, block_numel: int, dtype: torch.dtype, device: torch.device | str = "cpu", group_bytes: int = DECODE_GROUP_BYTES
    ) -> None:
        self.block_numel = block_numel  # block_size * KVH * D
        self.dtype = dtype
        self.device = device
        # how many blocks of K plus V one decode group may gather (at least one request's worth)
        self.group_blocks = max(1, group_bytes // (2 * block_numel * torch.empty((), dtype=dtype).element_size()))
        self._keys = torch.empty(0, block_numel, dtype=dtype, device=device)
        self._values = torch.empty(0, block_numel, dtype=dtype, device=device)

    def buffers(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [num_blocks, block_numel] views; grows (never shrinks) when a step needs more."""
        if num_blocks > self._keys.shape[0]:
            self._keys = torch.empty(num_blocks, self.block_numel, dtype=self.dtype, device=self.device)
            self._values = torch.empty(num_blocks, self.block_numel, dtype=self.dtype, device=self.device)
        return self._keys[:num_blocks], self._values[:num_blocks]


@dataclass(slots=True)
class DecodeBatch:
    token_index: torch.Tensor  # [B] long: rows of the packed batch, one query token per request
    block_tables: torch.Tensor  # [B * max_blocks] long, padded with block 0 (masked out)
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool: True where the key is in context
    covers_batch: bool  # token_index is exactly 0..T-1, so the output needs no scatter
    workspace: GatherWorkspace | None  # None: each layer allocates its own gather output
    context_lens: torch.Tensor  # [B] long
    window_masks: dict[int, torch.Tensor]  # sliding window -> mask as above, also False before the window (filled on first use)

    def window_mask(self, window: int) -> torch.Tensor:
        """The query sits at context_len - 1: keys in its window are >= context_len - window."""
        if window not in self.window_masks:
            key_pos = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.window_masks[window] = self.mask & (key_pos[None, :] >= self.context_lens[:, None] - window)[:, None, None, :]
        return self.window_masks[window]


@dataclass(slots=True)
class PrefillChunk:
    query_start: int
    query_end: int
    context_len: int
    context_blocks: torch.Tensor | None  # [num_blocks] long; None: no prefix, use this step's K/V
    mask: torch.Tensor | None  # [query_len, context_len] bool; None: plain causal
    device: torch.device | str
    window_masks: dict[int, torch.Tensor]  # sliding window -> [query_len, context_len] bool (filled on first use)

    def window_mask(self, window: int) -> torch.Tensor:
        """Causal and in the window: a key is in a window of w when query - key < w (transformers'
        sliding_window_overlay). Built by the first layer that asks, shared by the rest."""
        if window not in self.window_masks:
            device = self.device
            key_pos = torch.arange(self.context_len, device=device)  # [ctx]
            query_pos = torch.arange(self.context_len - (self.query_end - self.query_start), self.context_len, device=device)
            self.window_masks[window] = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] > query_pos[:, None] - window)
        return self.window_masks[window]


@dataclass(slots=True)
class PagedDecode:
    """Every decode row of a step, for torch.ops.tokenmill.paged_decode_attention (no gather)."""

    rows: torch.Tensor  # [B] long: rows of the packed batch
    block_tables: torch.Tensor  # [B, max_blocks] long: each row's pages, padded with 0 (never read)
    context_lens: torch.Tensor  # [B] long


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot (block_id * block_size + offset) per token
    decodes: list[DecodeBatch]  # groups of decode rows, each attended in one call per layer
    prefills: list[PrefillChunk]
    paged_decode: PagedDecode | None = None  # instead of decodes: every decode row, read in place


def span_slots(span: RequestSpan, block_size: int) -> tuple[int, list[int]]:
    """(pages its context fills, the cache slot of each token computed this step); raises ValueError
    if its block table cannot hold its context. Shared by the torch and Triton backends."""
    num_blocks = -(-span.context_len // block_size)
    if len(span.block_table) < num_blocks:
        raise ValueError(
            f"block table of {len(span.block_table)} blocks cannot hold context_len={span.context_len} "
            f"at block_size={block_size} (needs {num_blocks})"
        )
    table = span.block_table
    positions = range(span.context_len - span.query_len, span.context_len)
    return num_blocks, [table[p // block_size] * block_size + p % block_size for p in positions]


def _prefill_chunk(span: RequestSpan, num_blocks: int, device) -> PrefillChunk:
    query_end = span.query_start + span.query_len
    prefix_len = span.context_len - span.query_len
    if prefix_len == 0:  # the chunk is its whole context: attend over this step's K/V, plain causal
        return PrefillChunk(span.query_start, query_end, span.context_len, None, None, device, {})
    key_pos = torch.arange(span.context_len, device=device)  # [ctx]
    query_pos = torch.arange(prefix_len, span.context_len, device=device)  # [q_len]
    return PrefillChunk(
        span.query_start,
        query_end,
        span.context_len,
        torch.tensor(span.block_table[:num_blocks], dtype=torch.long, device=device),
        key_pos[None, :] <= query_pos[:, None],  # causal, shifted by the prefix
        device,
        {},
    )


def _padded_tables(spans: list[RequestSpan], block_size: int) -> tuple[list[list[int]], int]:
    """Each span's pages that hold its context, padded with page 0 to the longest: (tables, max_blocks)."""
    tables = [span.block_table[: -(-span.context_len // block_size)] for span in spans]
    max_blocks = max(len(table) for table in tables)
    return [list(table) + [0] * (max_blocks - len(table)) for table in tables], max_blocks


def _decode_batch(group: list[RequestSpan], block_size: int, num_tokens: int, device, workspace) -> DecodeBatch:
    padded, max_blocks = _padded_tables(group, block_size)
    context_lens = torch.tensor([span.context_len for span in group], dtype=torch.long, device=device)
    key_pos = torch.arange(max_blocks * block_size, device=device)
    rows = [span.query_start for span in group]
    return DecodeBatch(
        token_index=torch.tensor(rows, dtype=torch.long, device=device),
        block_tables=torch.tensor(padded, dtype=torch.long, device=device).view(-1),
        mask=(key_pos[None, :] < context_lens[:, None])[:, None, None, :],
        covers_batch=rows == list(range(num_tokens)),
        workspace=workspace,
        context_lens=context_lens,
        window_masks={},
    )


def _paged_decode(spans: list[RequestSpan], block_size: int, device) -> PagedDecode:
    padded, _ = _padded_tables(spans, block_size)
    return PagedDecode(
        rows=torch.tensor([span.query_start for span in spans], dtype=torch.long, device=device),
        block_tables=torch.tensor(padded, dtype=torch.long, device=device),
        context_lens=torch.tensor([span.context_len for span in spans], dtype=torch.long, device=device),
    )


def _decode_groups(decode_spans: list[RequestSpan], block_size: int, workspace: GatherWorkspace | None) -> list[list[RequestSpan]]:
    """Similar context lengths together (less padding), each group's padded gather within budget."""
    if workspace is None:
        return [decode_spans]
    groups: list[list[RequestSpan]] = [[]]
    for span in sorted(decode_spans, key=lambda span: span.context_len):
        padded_blocks = -(-span.context_len // block_size) * (len(groups[-1]) + 1)  # sorted: span is the longest
        if groups[-1] and padded_blocks > workspace.group_blocks:
            groups.append([])
        groups[-1].append(span)
    return groups


@dataclass(slots=True)
class HostAttentionPlan:
    """build_attention_metadata's host half: plain lists, no tensor, so it may be built on any thread
    (the worker's RPC thread prepares a step while the one before computes)."""

    slot_mapping: list[int]  # [T]: cache slot per token
    decode_groups: list[list[RequestSpan]]  # decode rows, grouped as _decode_groups() cuts them
    prefills: list[tuple[RequestSpan, int]]  # (prefill span, pages its context fills), batch order
    in_place: bool = False  # decode rows read the pages in place: decode_groups is one group, ungrouped


def plan_attention(
    spans: Sequence[RequestSpan], block_size: int, workspace: GatherWorkspace | None = None, in_place: bool = False
) -> HostAttentionPlan:
    """spans in packed-batch order; raises ValueError if a block table cannot hold its context.
    in_place: the decode rows go to paged_decode_attention (compiled ops loaded) instead of gathers."""
    slot_mapping: list[int] = []
    decode_spans: list[RequestSpan] = []
    prefills: list[tuple[RequestSpan, int]] = []
    for span in spans:
        num_blocks, slots = span_slots(span, block_size)
        slot_mapping.extend(slots)
        if span.query_len == 1:
            decode_spans.append(span)
        else:
            prefills.append((span, num_blocks))
    if in_place:
        return HostAttentionPlan(slot_mapping, [decode_spans] if decode_spans else [], prefills, in_place=True)
    groups = _decode_groups(decode_spans, block_size, workspace) if decode_spans else []
    return HostAttentionPlan(slot_mapping, groups, prefills)


def attention_metadata(
    plan: HostAttentionPlan, block_size: int, device: torch.device | str = "cpu", workspace: GatherWorkspace | None = None
) -> AttentionMetadata:
    """The plan's tensors on the device; workspace must be the one plan_attention() grouped for."""
    num_tokens = len(plan.slot_mapping)
    if plan.in_place:
        return AttentionMetadata(
            torch.tensor(plan.slot_mapping, dtype=torch.long, device=device), [],
            [_prefill_chunk(span, num_blocks, device) for span, num_blocks in plan.prefills],
            _paged_decode(plan.decode_groups[0], block_size, device) if plan.decode_groups else None)
    return AttentionMetadata(
        torch.tensor(plan.slot_mapping, dtype=torch.long, device=device),
        [_decode_batch(group, block_size, num_tokens, device, workspace) for group in plan.decode_groups],
        [_prefill_chunk(span, num_blocks, device) for span, num_blocks in plan.prefills],
    )


def build_attention_metadata(
    spans: Sequence[RequestSpan],
    block_size: int,
    device: torch.device | str = "cpu",
    workspace: GatherWorkspace | None = None,
) -> AttentionMetadata:
    """spans in packed-batch order; raises ValueError if a block table cannot hold its context."""
    return attention_metadata(plan_attention(spans, block_size, workspace), block_size, device, workspace)


def write_kv(
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T]
    kv_scales: KVScales = None,
) -> None:
    if kv_scales is not None:  # quantized pages: each row's values and its scale
        write_quantized(key_cache, kv_scales[0], k, slot_mapping)
        write_quantized(value_cache, kv_scales[1], v, slot_mapping)
        return
    key_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    value_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def gather_pages(cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor, dtype: torch.dtype,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """cache [num_blocks, block_size, KVH, D] -> its pages `blocks` [n] as [n, block_size * KVH * D] in dtype
    (dequantized when scales [num_blocks, block_size, KVH] are given), into out when given."""
    if scales is None:
        return torch.index_select(cache.flatten(1), 0, blocks, out=out)
    values = cache.index_select(0, blocks)  # [n, block_size, KVH, D], still one byte a value
    dequantized = dequantize_rows(values, scales.index_select(0, blocks), dtype).flatten(1)
    return dequantized if out is None else out.copy_(dequantized)


def _attend(queries, keys, values, mask, scale: float, softcap: float | None, sinks=None) -> torch.Tensor:
    """SDPA over [.., H, q, D] x [.., KVH, k, D] (GQA when H > KVH); mask: bool, True = attend, or None
    for plain causal. With a soft-cap (gemma2) the scores are capped before the mask, as transformers
    does, and with sinks (gpt-oss: one logit per query row, broadcast to [.., H, q, 1]) they join the softmax's
    denominator and are dropped after it, as transformers' eager_attention_forward does; SDPA can express
    neither, so those cases run the math in float32 here."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=queries.shape[-3] != keys.shape[-3],
        )
    group = queries.shape[-3] // keys.shape[-3]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=-3), values.repeat_interleave(group, dim=-3)
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale  # [.., H, q, k]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril(scores.shape[-1] - scores.shape[-2])
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        return torch.matmul(probs, values)
    # the sink is one more column of every row's logits, never masked; its probability is dropped (it has no value)
    combined = torch.cat((scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)), dim=-1)  # [.., H, q, k + 1]
    combined = combined - combined.max(dim=-1, keepdim=True).values  # as transformers: its order of rounding
    probs = torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1].to(values.dtype)
    return torch.matmul(probs, values)


def _decode_attention(q, key_cache, value_cache, decode: DecodeBatch, scale: float, window: int | None = None,
                      softcap: float | None = None, kv_scales: KVScales = None, sinks=None) -> torch.Tensor:
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    batch = decode.token_index.shape[0]
    # GQA without repeating K/V: the G query heads sharing a KV head act as G queries against it
    queries = q.index_select(0, decode.token_index).view(batch, num_kv_heads, -1, head_dim)  # [B, KVH, G, D]
    # index_select over whole blocks: several times faster on CPU than advanced indexing
    key_out = value_out = None
    if decode.workspace is not None:
        key_out, value_out = decode.workspace.buffers(decode.block_tables.shape[0])
    key_scales, value_scales = kv_scales if kv_scales is not None else (None, None)
    keys = gather_pages(key_cache, key_scales, decode.block_tables, q.dtype, key_out)
    values = gather_pages(value_cache, value_scales, decode.block_tables, q.dtype, value_out)
    keys = keys.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)  # [B, KVH, L, D]
    values = values.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    mask = decode.mask if window is None else decode.window_mask(window)
    # the G query heads of a KV head sit where SDPA puts query rows: head h = kvh * G + g has sink [kvh, g]
    head_sinks = None if sinks is None else sinks.view(1, num_kv_heads, -1, 1)
    out = _attend(queries, keys, values, mask, scale, softcap, head_sinks)  # [B, KVH, G, D]
    return out.reshape(batch, -1, head_dim)  # [B, H, D]


def _prefill_attention(q, k, v, key_cache, value_cache, chunk: PrefillChunk, scale: float, window: int | None = None,
                       softcap: float | None = None, kv_scales: KVScales = None, sinks=None) -> torch.Tensor:
    queries = q[chunk.query_start : chunk.query_end].transpose(0, 1)  # [H, q_len, D]
    if chunk.context_blocks is None:
        keys, values = k[chunk.query_start : chunk.query_end], v[chunk.query_start : chunk.query_end]
    else:  # the prefix from the pages (quantized ones dequantized), this chunk's own keys as written there too
        kv_shape = key_cache.shape[2:]
        key_scales, value_scales = kv_scales if kv_scales is not None else (None, None)
        keys = gather_pages(key_cache, key_scales, chunk.context_blocks, q.dtype).view(-1, *kv_shape)[: chunk.context_len]
        values = gather_pages(value_cache, value_scales, chunk.context_blocks, q.dtype).view(-1, *kv_shape)[
            : chunk.context_len]
    # 4-D inputs: with 3-D ones the CPU dispatcher falls back to the math kernel (4x slower at 1k tokens)
    mask = chunk.mask if window is None else chunk.window_mask(window)
    head_sinks = None if sinks is None else sinks.view(1, -1, 1, 1)  # [1, H, 1, 1]
    out = _attend(queries[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None], mask, scale, softcap,
                  head_sinks)  # [1, H, q_len, D]
    return out[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor,  # [T, H, D], already rotated
    k: torch.Tensor,  # [T, KVH, D], this step's keys (already written to the cache)
    v: torch.Tensor,  # [T, KVH, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    value_cache: torch.Tensor,
    attn_metadata: AttentionMetadata,
    scale: float,
    window: int | None = None,  # sliding window (attn_metadata must carry its masks); None: full context
    softcap: float | None = None,  # attention logit soft-cap (gemma2)
    kv_scales: KVScales = None,  # quantized pages' scales (worker.model.kv_quant); None: float pages
    sinks: torch.Tensor | None = None,  # [H] attention sinks (gpt-oss); None: none
) -> torch.Tensor:
    """Returns [T, H, D]: each token attends to its own request's context up to its position.
    A prefill chunk with no prefix attends over this step's own K/V (not read back from quantized pages)."""
    paged = attn_metadata.paged_decode
    args = (scale, window, softcap, kv_scales, sinks)
    if paged is not None or not attn_metadata.decodes:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if paged is not None:
            torch.ops.tokenmill.paged_decode_attention(q.contiguous(), key_cache, value_cache, paged.rows,
                                                       paged.block_tables, paged.context_lens, scale, window or 0,
                                                       softcap or 0.0, out, *(kv_scales or (None, None)), sinks)
        for chunk in attn_metadata.prefills:
            out[chunk.query_start : chunk.query_end] = _prefill_attention(q, k, v, key_cache, value_cache, chunk, *args)
        return out
    decodes = attn_metadata.decodes
    if len(decodes) == 1 and decodes[0].covers_batch:
        return _decode_attention(q, key_cache, value_cache, decodes[0], *args)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous even though q is a strided view
    for decode in decodes:
        out[decode.token_index] = _decode_attention(q, key_cache, value_cache, decode, *args)
    for chunk in attn_metadata.prefills:
        out[chunk.query_start : chunk.query_end] = _prefill_attention(q, k, v, key_cache, value_cache, chunk, *args)
    return out
