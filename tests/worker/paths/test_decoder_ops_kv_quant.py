"""The compiled decoder ops on quantized KV pages (worker/csrc/kv_quant_ops.cpp) against the dequantized reference:
rope_write_kv writes the values and scales worker.model.kv_quant's quantizer writes, and paged_decode_attention over
int8 / float8 pages equals the float attention over the dequantized pages (pages out of order, a shared prefix
page, GQA, windows, soft-cap, head dims with and without a vector tail), and the errors name the bad argument."""
from __future__ import annotations

import pytest
import torch

from tests.worker.kv_quant_cases import QUANT_DTYPES, paged_case
from worker.model.attention import attention_metadata, build_attention_metadata, paged_attention, plan_attention
from worker.model.kv_quant import dequantize_rows, quantize_rows
from worker.model.llama import apply_rope, rope_cos_sin
from worker.native_ops import cpu_ops_available

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="compiled CPU ops not built (scripts/build_cpu_ops.py)")
ops = torch.ops.tokenmill
# the op dequantizes to float32 where the reference rounds the dequantized pages to the model dtype first
MODEL_DTYPES = [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)]


def _quantized_pages(num_blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype):
    values = torch.zeros(2, num_blocks, block_size, kv_heads, dim, dtype=dtype).unbind(0)
    scales = torch.zeros(2, num_blocks, block_size, kv_heads, dtype=torch.float16).unbind(0)
    return values, scales


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
def test_rope_write_kv_quantizes_as_the_reference_does(dtype, model_dtype):
    torch.manual_seed(4)
    heads, kv_heads, dim, tokens = 6, 2, 20, 5  # 20: the int8 loop's tail
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 4).to(model_dtype)
    qkv[1, (heads + kv_heads) * dim : (heads + kv_heads + 1) * dim] = 0  # one all-zero V row: scale 0
    cos, sin = rope_cos_sin(torch.tensor([0, 7, 8, 30, 31]), dim, 10000.0, model_dtype)
    (key_cache, value_cache), (key_scales, value_scales) = _quantized_pages(10, 4, kv_heads, dim, dtype)
    slots = torch.tensor([3, 17, 0, 39, 22])
    with torch.inference_mode():
        q, k = ops.rope_write_kv(qkv, cos, sin, key_cache, value_cache, slots, heads, kv_heads, None, None, 0.0,
                                 key_scales, value_scales)
    ref_k = apply_rope(qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim), cos, sin)
    assert torch.equal(k, ref_k)  # the returned k stays unquantized (a prefill without prefix attends over it)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    for cache, scales, rows in ((key_cache, key_scales, k), (value_cache, value_scales, v)):
        expected_values, expected_scales = quantize_rows(rows, dtype)
        assert torch.equal(scales.view(-1, kv_heads)[slots], expected_scales)
        assert torch.equal(cache.view(-1, kv_heads, dim)[slots].view(torch.uint8), expected_values.view(torch.uint8))
    assert value_scales.view(-1, kv_heads)[17, 0] == 0


@pytest.mark.parametrize("model_dtype, rel", MODEL_DTYPES)
@pytest.mark.parametrize("dtype", QUANT_DTYPES)
@pytest.mark.parametrize("kv_heads, group, window, softcap, dim, with_sinks", [
    (2, 1, None, None, 16, False), (1, 3, 6, None, 64, False), (2, 4, None, 5.0, 12, False),
    (3, 3, None, None, 128, False), (2, 4, 6, None, 64, True)])  # the last: gpt-oss's attention sinks
def test_paged_decode_attention_on_quantized_pages_is_the_dequantized_reference(
        model_dtype, rel, dtype, kv_heads, group, window, softcap, dim, with_sinks):
    q, k, v, spans, block_size = paged_case(model_dtype, kv_heads, group, block_size=4, seed=dim, dim=dim)
    (key_cache, value_cache), scales = _quantized_pages(40, block_size, kv_heads, dim, dtype)
    gen = torch.Generator().manual_seed(dim)
    every_slot = torch.arange(40 * block_size)
    for cache, layer_scales in ((key_cache, scales[0]), (value_cache, scales[1])):
        values, row_scales = quantize_rows(torch.randn(40 * block_size, kv_heads, dim, generator=gen) * 2, dtype)
        cache.view(-1, kv_heads, dim).view(torch.uint8)[every_slot] = values.view(torch.uint8)
        layer_scales.view(-1, kv_heads)[every_slot] = row_scales
    gathered = build_attention_metadata(spans, block_size)
    in_place = attention_metadata(plan_attention(spans, block_size, in_place=True), block_size)
    sinks = (torch.randn(kv_heads * group, generator=gen) * 2).to(model_dtype) if with_sinks else None
    with torch.inference_mode():
        ours = paged_attention(q, k, v, key_cache, value_cache, in_place, 0.25, window, softcap, scales, sinks)
        float_keys = dequantize_rows(key_cache, scales[0], model_dtype)
        float_values = dequantize_rows(value_cache, scales[1], model_dtype)
        expected = paged_attention(q, k, v, float_keys, float_values, gathered, 0.25, window, softcap, None, sinks)
    decode_rows = in_place.paged_decode.rows
    err = ((ours[decode_rows].float() - expected[decode_rows].float()).norm() / expected[decode_rows].float().norm())
    assert err.item() <= rel, f"relative error {err.item():.2e} > {rel:.0e}"


def test_quantized_pages_without_matching_scales_are_refused_by_name():
    q, _, _, spans, block_size = paged_case(torch.float32, 2, 2, block_size=4, seed=0)
    (key_cache, value_cache), (key_scales, value_scales) = _quantized_pages(40, block_size, 2, 16, torch.int8)
    rows, tables, lens = torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1])
    with pytest.raises(RuntimeError, match=r"value_scales must be contiguous float16 \[40, 4, 2\]"):
        ops.paged_decode_attention(q, key_cache, value_cache, rows, tables, lens, 1.0, 0, 0.0, torch.empty_like(q),
                                   key_scales, value_scales[:, :, :1])
    with pytest.raises(RuntimeError, match="caches must be contiguous .* of Float"):
        ops.paged_decode_attention(q, key_cache, value_cache, rows, tables, lens, 1.0, 0, 0.0, torch.empty_like(q))
    float_cache = torch.zeros(40, block_size, 2, 16)
    with pytest.raises(RuntimeError, match="key_scales are given, so its cache must be int8 or float8_e4m3fn"):
        ops.paged_decode_attention(q, float_cache, float_cache, rows, tables, lens, 1.0, 0, 0.0, torch.empty_like(q),
                                   key_scales, value_scales)
