"""The Triton kernels on quantized KV pages (--kv-cache-dtype int8 / fp8_e4m3) against the dequantized reference
(runs under the Triton interpreter without a GPU): write_kv stores what worker.model.kv_quant's quantizer stores,
and decode and prefill attention over int8 / float8 pages equal the float attention over the dequantized pages.
Unwritten slots hold a NaN scale, so a kernel that reads past a context returns NaN and fails."""
from __future__ import annotations

import pytest
import torch

from tests.worker.kernels.paged_reference import DEVICE, PagedCache, make_paged_cache, random_query, reference_attention
from tests.worker.kernels.tolerances import assert_close
from worker.kernels.kv_write import write_kv
from worker.kernels.paged_decode_attention import paged_decode_attention
from worker.kernels.prefill_attention import paged_prefill_attention
from worker.model.kv_quant import dequantize_rows, quantize_rows

QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]
CONTEXTS = [1, 17, 33, 100]


def _quantized(cache: PagedCache, kv_dtype: torch.dtype, dtype: torch.dtype):
    """(the quantized pages and their scales, the dequantized pages as a float PagedCache for the reference)."""
    pages, scales, dequantized = [], [], []
    for floats in (cache.key_cache, cache.value_cache):
        unwritten = floats.isnan().any(-1)
        values, row_scales = quantize_rows(floats.nan_to_num(0.0), kv_dtype)
        row_scales[unwritten] = float("nan")
        pages.append(values)
        scales.append(row_scales)
        dequantized.append(dequantize_rows(values, row_scales, dtype))
    reference = PagedCache(dequantized[0], dequantized[1], cache.block_tables, cache.context_lens)
    return pages, tuple(scales), reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", QUANT_DTYPES)
def test_write_kv_quantizes_each_row_as_the_reference(kv_dtype, dtype):
    generator = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 5, 16, 3, 24, 11  # KVH and D not powers of two
    qkv = (torch.randn(num_tokens, 6 * num_kv_heads * head_dim, generator=generator) * 5).to(dtype).to(DEVICE)
    kv = qkv[:, 4 * num_kv_heads * head_dim :].view(num_tokens, 2 * num_kv_heads, head_dim)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]  # strided, as the model's slices are
    value[3, 1] = 0  # an all-zero row: scale 0
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=kv_dtype, device=DEVICE)
    value_cache = torch.zeros_like(key_cache)
    scales = torch.zeros(2, num_blocks, block_size, num_kv_heads, dtype=torch.float16, device=DEVICE).unbind(0)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens].to(DEVICE)
    slot_mapping[5] = -1  # padding: writes nothing

    write_kv(key, value, key_cache, value_cache, slot_mapping, scales)

    written = slot_mapping >= 0
    for cache, layer_scales, rows in ((key_cache, scales[0], key), (value_cache, scales[1], value)):
        expected_values, expected_scales = quantize_rows(rows[written], kv_dtype)
        assert torch.equal(layer_scales.view(-1, num_kv_heads)[slot_mapping[written]], expected_scales)
        got = cache.view(-1, num_kv_heads, head_dim)[slot_mapping[written]]
        assert torch.equal(got.view(torch.uint8), expected_values.view(torch.uint8))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slot_mapping[written]] = False
    assert not scales[0].view(-1, num_kv_heads)[untouched].any()


@pytest.mark.parametrize("dtype, num_heads, num_kv_heads, block_size, head_dim",
                         [(torch.float32, 6, 2, 16, 32), (torch.bfloat16, 9, 3, 16, 64)])
@pytest.mark.parametrize("kv_dtype", QUANT_DTYPES)
@pytest.mark.parametrize("window, softcap, num_splits", [(None, None, 1), (20, None, 3), (None, 5.0, 1)])
def test_decode_attention_reads_quantized_pages_as_the_dequantized_reference(
        kv_dtype, dtype, num_heads, num_kv_heads, block_size, head_dim, window, softcap, num_splits):
    generator = torch.Generator().manual_seed(1)
    cache = make_paged_cache(CONTEXTS, block_size, num_kv_heads, head_dim, dtype, generator)
    query = random_query(len(CONTEXTS), num_heads, head_dim, dtype, generator)
    (key_cache, value_cache), scales, reference = _quantized(cache, kv_dtype, dtype)

    out = paged_decode_attention(query, key_cache, value_cache, cache.block_tables, cache.context_lens, 0.2,
                                 num_splits=num_splits, window=window, softcap=softcap, kv_scales=scales)

    assert out.dtype == dtype
    assert_close(out, reference_attention(query, reference, [1] * len(CONTEXTS), 0.2, window, softcap), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", QUANT_DTYPES)
def test_prefill_attention_reads_quantized_pages_as_the_dequantized_reference(kv_dtype, dtype):
    generator = torch.Generator().manual_seed(2)
    context_lens, query_lens = [5, 40, 70], [5, 13, 30]  # a whole prompt, and chunks after a cached prefix
    cache = make_paged_cache(context_lens, 16, 2, 32, dtype, generator)
    query = random_query(sum(query_lens), 8, 32, dtype, generator)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    (key_cache, value_cache), scales, reference = _quantized(cache, kv_dtype, dtype)

    out = paged_prefill_attention(query, key_cache, value_cache, cache.block_tables, starts, cache.context_lens, 0.2,
                                  kv_scales=scales)

    assert_close(out, reference_attention(query, reference, query_lens, 0.2), dtype)


def test_quantized_pages_need_matching_scales_and_float_pages_refuse_them():
    generator = torch.Generator().manual_seed(3)
    cache = make_paged_cache([5], 16, 2, 32, torch.float32, generator)
    query = random_query(1, 4, 32, torch.float32, generator)
    (key_cache, value_cache), scales, _ = _quantized(cache, torch.int8, torch.float32)
    with pytest.raises(ValueError, match=r"key_cache has dtype torch.int8, expected torch.float32 \(query's dtype\)"):
        paged_decode_attention(query, key_cache, value_cache, cache.block_tables, cache.context_lens, 1.0)
    with pytest.raises(ValueError, match=r"value_scales has shape \[3, 16, 1\], expected \[3, 16, 2\]"):
        paged_decode_attention(query, key_cache, value_cache, cache.block_tables, cache.context_lens, 1.0,
                               kv_scales=(scales[0], scales[1][:, :, :1]))
    with pytest.raises(ValueError, match=r"key_cache has dtype torch.float32, expected torch.int8 or torch.float8_e4m3fn"):
        paged_decode_attention(query, cache.key_cache, cache.value_cache, cache.block_tables, cache.context_lens, 1.0,
                               kv_scales=scales)
