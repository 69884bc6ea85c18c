"""paged_decode_attention against the torch reference (runs under the Triton interpreter without a GPU)."""
import pytest
import torch

from tests.worker.kernels.paged_reference import (DEVICE, HEAD_SHAPE_NAMES, HEAD_SHAPES, make_paged_cache,
                                                   random_cache_and_query, random_query, reference_attention)
from tests.worker.kernels.tolerances import assert_close
from worker.kernels.paged_decode_attention import paged_decode_attention
from worker.kernels.prefill_attention import paged_prefill_attention

CONTEXTS = [1, 17, 33, 100]


@pytest.mark.parametrize(HEAD_SHAPE_NAMES, [*HEAD_SHAPES, (torch.bfloat16, 8, 1, 16, 32)])
def test_matches_reference(dtype, num_heads, num_kv_heads, block_size, head_dim):
    cache, query = random_cache_and_query(CONTEXTS, len(CONTEXTS), dtype, num_heads, num_kv_heads, block_size,
                                          head_dim)
    scale = head_dim**-0.5

    out = paged_decode_attention(query, cache.key_cache, cache.value_cache, cache.block_tables, cache.context_lens, scale)

    assert out.shape == query.shape and out.dtype == dtype
    assert_close(out, reference_attention(query, cache, [1] * len(CONTEXTS), scale), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_context_merges_to_the_same_output(dtype):
    # each context is cut into 3 splits of a multiple of 64 keys: 1, 17 and 33 leave two splits empty, 100 fills two
    generator = torch.Generator().manual_seed(1)
    cache = make_paged_cache(CONTEXTS, 32, 2, 32, dtype, generator)
    query = random_query(len(CONTEXTS), 6, 32, dtype, generator)

    out = paged_decode_attention(
        query, cache.key_cache, cache.value_cache, cache.block_tables, cache.context_lens, 0.2, num_splits=3
    )

    assert_close(out, reference_attention(query, cache, [1] * len(CONTEXTS), 0.2), dtype)


def test_strided_inputs_and_output():
    """query sliced out of a fused qkv output, block_tables a column slice of a wider buffer, caches
    that are every other KV head of a larger tensor, and out a strided view."""
    generator = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads, head_dim = 6, 2, 32
    dense = make_paged_cache(CONTEXTS, 16, num_kv_heads, head_dim, torch.float32, generator)
    wide = torch.full((*dense.key_cache.shape[:2], 2 * num_kv_heads, head_dim), float("nan"), device=DEVICE)
    key_cache, value_cache = wide.clone(), wide.clone()
    key_cache[:, :, ::2], value_cache[:, :, ::2] = dense.key_cache, dense.value_cache
    tables = torch.full((len(CONTEXTS), dense.block_tables.shape[1] + 5), -1, dtype=torch.int32, device=DEVICE)
    tables[:, : dense.block_tables.shape[1]] = dense.block_tables
    qkv = torch.randn(len(CONTEXTS), (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(DEVICE)
    query = qkv[:, : num_heads * head_dim].view(len(CONTEXTS), num_heads, head_dim)
    out_buffer = torch.zeros(len(CONTEXTS), num_heads, 2 * head_dim, device=DEVICE)
    out = out_buffer[:, :, head_dim:]
    assert not query.is_contiguous() and not key_cache[:, :, ::2].is_contiguous() and not out.is_contiguous()

    returned = paged_decode_attention(
        query,
        key_cache[:, :, ::2],
        value_cache[:, :, ::2],
        tables[:, : dense.block_tables.shape[1]],
        dense.context_lens,
        0.25,
        out=out,
    )

    assert returned is out
    assert_close(out, reference_attention(query, dense, [1] * len(CONTEXTS), 0.25), torch.float32)
    assert torch.all(out_buffer[:, :, :head_dim] == 0)  # nothing written outside the view


@pytest.mark.parametrize("num_splits", [1, 2])
def test_zero_context_row_gives_zeros(num_splits):
    # a padded row of a captured batch has context_len 0: zeros, not NaN, and the other rows unaffected
    generator = torch.Generator().manual_seed(3)
    cache = make_paged_cache([140, 5], 16, 1, 16, torch.float32, generator)  # 2 splits: 128 + 12 keys
    query = random_query(2, 2, 16, torch.float32, generator)
    context_lens = torch.tensor([140, 0], dtype=torch.int32, device=DEVICE)

    out = paged_decode_attention(
        query, cache.key_cache, cache.value_cache, cache.block_tables, context_lens, 0.25, num_splits=num_splits
    )

    assert torch.all(out[1] == 0)
    assert_close(out[:1], reference_attention(query[:1], cache, [1], 0.25), torch.float32)


def _valid_args():
    generator = torch.Generator().manual_seed(4)
    cache = make_paged_cache([3, 20], 16, 2, 16, torch.float16, generator)
    query = random_query(2, 4, 16, torch.float16, generator)
    return dict(
        query=query,
        key_cache=cache.key_cache,
        value_cache=cache.value_cache,
        block_tables=cache.block_tables,
        context_lens=cache.context_lens,
        scale=0.25,
    )


@pytest.mark.parametrize(
    "name, make_bad, message",
    [
        ("query", lambda args: args["query"].double(), r"query has dtype torch.float64, expected one of torch.float32"),
        (
            "key_cache",
            lambda args: args["key_cache"].float(),
            r"key_cache has dtype torch.float32, expected torch.float16 \(query's dtype\)",
        ),
        ("value_cache", lambda args: args["value_cache"][:, :8], r"value_cache has shape \[\d+, 8, 2, 16\]"),
        ("block_tables", lambda args: args["block_tables"].long(), r"block_tables has dtype torch.int64"),
        ("context_lens", lambda args: args["context_lens"][:1], r"context_lens has shape \[1\], expected \[2\]"),
        ("query", lambda args: args["query"][:, :3], r"query has 3 heads, expected a multiple of the caches' 2"),
        ("query", lambda args: args["query"].transpose(1, 2).contiguous().transpose(1, 2), r"query has strides"),
    ],
)
def test_rejects_bad_arguments(name, make_bad, message):
    args = _valid_args()
    args[name] = make_bad(args)
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)


def test_rejects_head_dim_that_is_not_a_power_of_two():
    generator = torch.Generator().manual_seed(5)
    cache = make_paged_cache([3], 16, 1, 24, torch.float32, generator)
    query = random_query(1, 1, 24, torch.float32, generator)
    with pytest.raises(ValueError, match=r"query has head_dim 24, expected a power of two"):
        paged_decode_attention(query, cache.key_cache, cache.value_cache, cache.block_tables, cache.context_lens, 0.2)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window, softcap", [(7, None), (None, 2.0), (20, 1.5)])
def test_sliding_window_and_softcap_match_reference(num_splits, window, softcap):
    # windows shorter than some contexts (100, 33, 17) and longer than others (1); with 3 splits
    # whole splits fall before the window; the cap is small enough to change the scores
    generator = torch.Generator().manual_seed(6)
    cache = make_paged_cache(CONTEXTS + [200], 16, 2, 32, torch.float32, generator)
    query = 3 * random_query(len(CONTEXTS) + 1, 6, 32, torch.float32, generator)

    out = paged_decode_attention(query, cache.key_cache, cache.value_cache, cache.block_tables, cache.context_lens,
                                 0.2, num_splits=num_splits, window=window, softcap=softcap)

    expected = reference_attention(query, cache, [1] * (len(CONTEXTS) + 1), 0.2, window=window, softcap=softcap)
    assert_close(out, expected, torch.float32)
    assert not torch.allclose(expected, reference_attention(query, cache, [1] * (len(CONTEXTS) + 1), 0.2), atol=1e-3)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window", [None, 20])
def test_attention_sinks_match_reference(num_splits, window):
    """gpt-oss's sinks: one logit per query head in every softmax's denominator, counted once over the splits
    (the window of 20 leaves whole splits of the 200-token context without a key, the 1-token one too)."""
    generator = torch.Generator().manual_seed(9)
    cache = make_paged_cache(CONTEXTS + [200], 16, 2, 32, torch.float32, generator)
    query = 3 * random_query(len(CONTEXTS) + 1, 6, 32, torch.float32, generator)
    sinks = torch.randn(6, generator=generator).to(DEVICE)
    query_lens = [1] * (len(CONTEXTS) + 1)

    out = paged_decode_attention(query, cache.key_cache, cache.value_cache, cache.block_tables, cache.context_lens,
                                 0.2, num_splits=num_splits, window=window, sinks=sinks)

    expected = reference_attention(query, cache, query_lens, 0.2, window=window, sinks=sinks)
    assert_close(out, expected, torch.float32)
    assert not torch.allclose(expected, reference_attention(query, cache, query_lens, 0.2, window=window), atol=1e-2)


def test_both_attention_kernels_refuse_a_value_cache_laid_out_otherwise_than_the_key_cache():
    """Same shape, another page layout: the kernels read both caches through the key cache's strides, so
    the shared check (check_query_and_caches) refuses it, for decode and prefill alike."""
    generator = torch.Generator().manual_seed(6)
    cache = make_paged_cache([4], 16, 2, 16, torch.float32, generator)
    other_layout = cache.value_cache.transpose(1, 2).contiguous().transpose(1, 2)
    message = r"value_cache has strides \[\d+, 16, \d+, 1\], expected key_cache's \[\d+, 32, 16, 1\]"
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(random_query(1, 4, 16, torch.float32, generator), cache.key_cache, other_layout,
                               cache.block_tables, cache.context_lens, 0.25)
    query_start_loc = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(random_query(4, 4, 16, torch.float32, generator), cache.key_cache, other_layout,
                                cache.block_tables, query_start_loc, cache.context_lens, 0.25)
