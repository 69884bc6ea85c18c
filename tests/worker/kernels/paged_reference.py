"""Plain-torch reference for the paged attention kernels, and random paged caches to run them on.

The caches start as NaN everywhere and only the slots inside some request's context get values, so a
kernel that reads (and does not mask) a slot past a context, or a padding entry of a block table,
returns NaN and fails the comparison.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# the head shapes both attention kernels are checked at; each test file adds its own bfloat16 row
HEAD_SHAPE_NAMES = "dtype, num_heads, num_kv_heads, block_size, head_dim"
HEAD_SHAPES = [
    (torch.float32, 2, 2, 16, 32),  # GQA ratio 1
    (torch.float16, 6, 2, 32, 32),  # ratio 3
    (torch.float32, 8, 1, 32, 16),  # ratio 8
    (torch.float16, 9, 3, 16, 64),  # SmolLM2's heads
]


def random_query(num_rows: int, num_heads: int, head_dim: int, dtype: torch.dtype, generator) -> torch.Tensor:
    """[rows, H, D]: one row per request (decode) or per token (prefill)."""
    return torch.randn(num_rows, num_heads, head_dim, generator=generator).to(dtype).to(DEVICE)


@dataclass
class PagedCache:
    key_cache: torch.Tensor  # [N, block_size, KVH, D]
    value_cache: torch.Tensor  # [N, block_size, KVH, D]
    block_tables: torch.Tensor  # [R, max_blocks] int32, pages in random order, padding -> an all-NaN page
    context_lens: torch.Tensor  # [R] int32


def make_paged_cache(
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    extra_table_width: int = 1,
) -> PagedCache:
    pages_per_request = [-(-length // block_size) for length in context_lens]
    num_pages = sum(pages_per_request) + 2  # + one never-written page for padding entries, + one spare
    shape = (num_pages, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_pages, generator=generator)  # non-monotonic page numbers
    poison_page, pages = order[0], order[1:].tolist()
    width = max(pages_per_request) + extra_table_width
    block_tables = torch.full((len(context_lens), width), int(poison_page), dtype=torch.int32)
    for request, (length, count) in enumerate(zip(context_lens, pages_per_request)):
        table, pages = pages[:count], pages[count:]
        block_tables[request, :count] = torch.tensor(table, dtype=torch.int32)
        for position in range(length):
            page, offset = table[position // block_size], position % block_size
            key_cache[page, offset] = torch.randn(num_kv_heads, head_dim, generator=generator).to(dtype)
            value_cache[page, offset] = torch.randn(num_kv_heads, head_dim, generator=generator).to(dtype)
    return PagedCache(
        key_cache.to(DEVICE),
        value_cache.to(DEVICE),
        block_tables.to(DEVICE),
        torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
    )


def random_cache_and_query(context_lens: list[int], num_rows: int, dtype: torch.dtype, num_heads: int,
                           num_kv_heads: int, block_size: int, head_dim: int) -> tuple[PagedCache, torch.Tensor]:
    """A paged cache over context_lens and a [num_rows, H, D] query, from one generator seeded 0."""
    generator = torch.Generator().manual_seed(0)
    cache = make_paged_cache(context_lens, block_size, num_kv_heads, head_dim, dtype, generator)
    return cache, random_query(num_rows, num_heads, head_dim, dtype, generator)


def reference_attention(
    query: torch.Tensor,  # [T, H, D], requests packed back to back
    cache: PagedCache,
    query_lens: list[int],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, H, D] float32: request r's i-th token (position context_len - query_len + i) attends to its
    keys 0..position (the last `window` of them when set; scores soft-capped as gemma2 does when
    softcap is set; sinks [H]: one more logit per head in the softmax, dropped after it, as transformers'
    gpt-oss); query head h reads KV head h // (H // KVH)."""
    num_heads = query.shape[1]
    block_size, num_kv_heads, head_dim = cache.key_cache.shape[1:]
    group = num_heads // num_kv_heads
    outputs = []
    start = 0
    for request, query_len in enumerate(query_lens):
        context_len = int(cache.context_lens[request])
        pages = cache.block_tables[request, : -(-context_len // block_size)].long()
        keys = cache.key_cache[pages].reshape(-1, num_kv_heads, head_dim)[:context_len].float()  # [L, KVH, D]
        values = cache.value_cache[pages].reshape(-1, num_kv_heads, head_dim)[:context_len].float()
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [L, H, D]
        queries = query[start : start + query_len].float()  # [q, H, D]
        scores = torch.einsum("qhd,lhd->hql", queries, keys) * scale
        query_positions = torch.arange(context_len - query_len, context_len, device=query.device)
        key_positions = torch.arange(context_len, device=query.device)[None, :]
        hidden = key_positions > query_positions[:, None]  # [q, L]
        if window is not None:
            hidden |= key_positions <= query_positions[:, None] - window
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink_column = sinks.float().to(scores.device)[:, None, None].expand(-1, query_len, 1)  # [H, q, 1]
            probs = torch.cat((scores, sink_column), dim=-1).softmax(-1)[..., :-1]
        outputs.append(torch.einsum("hql,lhd->qhd", probs, values))
        start += query_len
    return torch.cat(outputs)
