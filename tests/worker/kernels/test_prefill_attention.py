"""paged_prefill_attention against the torch reference (runs under the Triton interpreter without a GPU)."""
import pytest
import torch

from tests.worker.kernels.paged_reference import (DEVICE, HEAD_SHAPE_NAMES, HEAD_SHAPES, make_paged_cache,
                                                   random_cache_and_query, random_query, reference_attention)
from tests.worker.kernels.tolerances import assert_close
from worker.kernels.prefill_attention import paged_prefill_attention

# one launch: a whole prompt, a chunk after 33 cached tokens, two decode rows (contexts 1 and 17), and
# a chunk of 40 after 60 cached tokens that spans several query tiles at GQA ratios 3 and 8
QUERY_LENS = [5, 20, 1, 1, 40]
CONTEXTS = [5, 53, 1, 17, 100]


def _query_start_loc(query_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(HEAD_SHAPE_NAMES, [*HEAD_SHAPES, (torch.bfloat16, 3, 1, 16, 32)])
def test_mixed_batch_matches_reference(dtype, num_heads, num_kv_heads, block_size, head_dim):
    cache, query = random_cache_and_query(CONTEXTS, sum(QUERY_LENS), dtype, num_heads, num_kv_heads, block_size,
                                          head_dim)
    scale = head_dim**-0.5

    out = paged_prefill_attention(
        query,
        cache.key_cache,
        cache.value_cache,
        cache.block_tables,
        _query_start_loc(QUERY_LENS),
        cache.context_lens,
        scale,
    )

    assert out.shape == query.shape and out.dtype == dtype
    assert_close(out, reference_attention(query, cache, QUERY_LENS, scale), dtype)


def test_one_long_request_spans_query_tiles():
    # ratio 1, float32: 32 tokens per query tile, so 70 tokens after a 30-token prefix take three tiles
    generator = torch.Generator().manual_seed(1)
    cache = make_paged_cache([100], 16, 1, 16, torch.float32, generator)
    query = random_query(70, 1, 16, torch.float32, generator)

    out = paged_prefill_attention(
        query, cache.key_cache, cache.value_cache, cache.block_tables, _query_start_loc([70]), cache.context_lens, 0.3
    )

    assert_close(out, reference_attention(query, cache, [70], 0.3), torch.float32)


def test_strided_query_and_output_and_padding_rows():
    """query sliced out of a fused qkv output, block_tables a column slice of a wider buffer, out a
    strided view; rows past query_start_loc[R] (padding) are not written."""
    generator = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads, head_dim = 6, 2, 32
    query_lens, contexts = [7, 1], [30, 12]
    cache = make_paged_cache(contexts, 16, num_kv_heads, head_dim, torch.float32, generator)
    num_tokens = sum(query_lens) + 3  # 3 padding rows at the end
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(DEVICE)
    query = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    tables = torch.full((2, cache.block_tables.shape[1] + 3), -1, dtype=torch.int32, device=DEVICE)
    tables[:, : cache.block_tables.shape[1]] = cache.block_tables
    out_buffer = torch.zeros(num_tokens, num_heads, 2 * head_dim, device=DEVICE)
    out = out_buffer[:, :, :head_dim]
    assert not query.is_contiguous() and not out.is_contiguous()

    returned = paged_prefill_attention(
        query,
        cache.key_cache,
        cache.value_cache,
        tables[:, : cache.block_tables.shape[1]],
        _query_start_loc(query_lens),
        cache.context_lens,
        0.2,
        out=out,
    )

    assert returned is out
    assert_close(out[: sum(query_lens)], reference_attention(query, cache, query_lens, 0.2), torch.float32)
    assert torch.all(out_buffer[sum(query_lens) :] == 0) and torch.all(out_buffer[:, :, head_dim:] == 0)


def _valid_args():
    generator = torch.Generator().manual_seed(3)
    cache = make_paged_cache([3, 20], 16, 2, 16, torch.float16, generator)
    return dict(
        query=random_query(4, 4, 16, torch.float16, generator),
        key_cache=cache.key_cache,
        value_cache=cache.value_cache,
        block_tables=cache.block_tables,
        query_start_loc=_query_start_loc([3, 1]),
        context_lens=cache.context_lens,
        scale=0.25,
    )


@pytest.mark.parametrize(
    "name, make_bad, message",
    [
        ("value_cache", lambda args: args["value_cache"].bfloat16(), r"value_cache has dtype torch.bfloat16, expected"),
        ("query_start_loc", lambda args: args["query_start_loc"].long(), r"query_start_loc has dtype torch.int64"),
        ("query_start_loc", lambda args: args["query_start_loc"][:2], r"block_tables has shape \[2, \d+\], expected \[1, "),
        ("query_start_loc", lambda args: args["query_start_loc"].repeat_interleave(2)[::2], r"query_start_loc has strides"),
        ("context_lens", lambda args: args["context_lens"].float(), r"context_lens has dtype torch.float32"),
        ("block_tables", lambda args: args["block_tables"][0], r"block_tables has shape \[\d+\], expected \[2, \*\]"),
        ("out", lambda args: args["query"][:, :, :8], r"out has shape \[4, 4, 8\], expected \[4, 4, 16\]"),
    ],
)
def test_rejects_bad_arguments(name, make_bad, message):
    args = _valid_args()
    args[name] = make_bad(args)
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(**args)


@pytest.mark.parametrize("window, softcap", [(7, None), (None, 2.0), (50, 1.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sliding_window_and_softcap_match_reference(window, softcap, dtype):
    # the 40-token chunk after 60 cached tokens spans query tiles whose first rows start their windows
    # in different key blocks; a decode row and a short whole prompt sit beside it
    generator = torch.Generator().manual_seed(7)
    cache = make_paged_cache(CONTEXTS, 16, 2, 32, dtype, generator)
    query = 3 * random_query(sum(QUERY_LENS), 6, 32, dtype, generator)

    out = paged_prefill_attention(query, cache.key_cache, cache.value_cache, cache.block_tables,
                                  _query_start_loc(QUERY_LENS), cache.context_lens, 0.2, window=window, softcap=softcap)

    expected = reference_attention(query, cache, QUERY_LENS, 0.2, window=window, softcap=softcap)
    assert_close(out, expected, dtype)
    assert not torch.allclose(expected, reference_attention(query, cache, QUERY_LENS, 0.2), atol=1e-2)


@pytest.mark.parametrize("window", [None, 7])
def test_attention_sinks_match_reference(window):
    """gpt-oss's sinks: each row's softmax starts from its head's sink (a chunk after a prefix, a whole prompt,
    decode rows, a chunk over several query tiles)."""
    generator = torch.Generator().manual_seed(10)
    cache = make_paged_cache(CONTEXTS, 16, 2, 32, torch.float32, generator)
    query = 3 * random_query(sum(QUERY_LENS), 6, 32, torch.float32, generator)
    sinks = torch.randn(6, generator=generator).to(DEVICE)

    out = paged_prefill_attention(query, cache.key_cache, cache.value_cache, cache.block_tables,
                                  _query_start_loc(QUERY_LENS), cache.context_lens, 0.2, window=window, sinks=sinks)

    expected = reference_attention(query, cache, QUERY_LENS, 0.2, window=window, sinks=sinks)
    assert_close(out, expected, torch.float32)
    assert not torch.allclose(expected, reference_attention(query, cache, QUERY_LENS, 0.2, window=window), atol=1e-2)


def test_rejects_a_bad_window():
    generator = torch.Generator().manual_seed(8)
    cache = make_paged_cache([4], 16, 1, 16, torch.float32, generator)
    with pytest.raises(ValueError, match="window is 0, expected None or >= 1"):
        paged_prefill_attention(random_query(4, 1, 16, torch.float32, generator), cache.key_cache, cache.value_cache,
                                cache.block_tables, _query_start_loc([4]), cache.context_lens, 0.25, window=0)
