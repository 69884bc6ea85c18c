"""A paged attention step for the quantized-KV tests (torch reference and compiled ops): decode rows and one prefill
chunk over a cache whose pages are shuffled, a page shared as a prefix-cache hit, context lengths ending mid-page."""
from __future__ import annotations

import random

import torch

from worker.step_batch import RequestSpan

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]


def paged_case(dtype: torch.dtype, kv_heads: int, group: int, block_size: int, seed: int, dim: int = 16,
               num_blocks: int = 40):
    """(q [T, H, D], k, v [T, KVH, D] in dtype, spans, block_size); request 3 is a 4-token prefill chunk over a prefix."""
    gen = torch.Generator().manual_seed(seed)
    pages = list(range(num_blocks))
    random.Random(seed).shuffle(pages)
    spans, row = [], 0
    for i, n in enumerate([1, block_size + 3, 3 * block_size, 2 * block_size + 1, 5]):
        table = [pages.pop() for _ in range(-(-n // block_size))]
        if i == 1:
            table[0] = spans[0].block_table[0]  # the same first page as request 0
        query_len = 4 if i == 3 else 1
        spans.append(RequestSpan(row, query_len, n, table))
        row += query_len
    q = torch.randn(row, kv_heads * group, dim, generator=gen).to(dtype)
    k = (torch.randn(row, kv_heads, dim, generator=gen) * 3).to(dtype)
    v = torch.randn(row, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v, spans, block_size
