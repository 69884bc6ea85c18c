"""The compiled decoder ops (worker/csrc/decoder_ops.cpp) against the plain-torch reference they replace:
each op alone (float32 to float rounding, bfloat16 to its own rounding), decode attention read from the
pages in place (pages out of order, partial last pages, a page shared as a prefix-cache hit, GQA ratios
1/3/4, sliding windows, soft-cap, decode rows among prefill rows), and the errors that name the bad value.
The whole model on these ops against transformers: tests/worker/model/test_model_parity.py (fused=True)."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from worker.model.attention import (attention_metadata, build_attention_metadata, paged_attention, plan_attention,
                                    write_kv)
from worker.model.llama import RMSNorm, apply_rope, rope_cos_sin
from worker.native_ops import cpu_ops_available
from worker.step_batch import RequestSpan

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="compiled CPU ops not built (scripts/build_cpu_ops.py)")
ops = torch.ops.tokenmill
DTYPES = [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)]


def close(ours: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    err = ((ours.float() - expected.float()).norm() / expected.float().norm()).item()
    assert err <= rel, f"relative error {err:.2e} > {rel:.0e}"


@pytest.mark.parametrize("dtype, rel", DTYPES)
def test_rms_norms_match_the_reference_module(dtype, rel):
    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6).to(dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    x, delta = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    with torch.inference_mode():
        close(ops.rms_norm(x, norm.weight, norm.eps), norm(x), rel)
        h, normed = ops.add_rms_norm(x, delta, norm.weight, norm.eps)
        assert torch.equal(h, x + delta)
        close(normed, norm(x + delta), rel)
        wide = torch.randn(5, 128).to(dtype)
        close(ops.rms_norm(wide[:, :96], norm.weight, norm.eps), norm(wide[:, :96]), rel)  # rows 128 apart


@pytest.mark.parametrize("dtype, rel", DTYPES)
@pytest.mark.parametrize("gelu", [False, True])
def test_act_mul_is_swiglu_or_geglu(dtype, rel, gelu):
    torch.manual_seed(1)
    gate_up = (torch.randn(3, 2 * 300) * 4).to(dtype)  # 300: a tail past the 8-lane loop; * 4: exp's range
    gate, up = gate_up.chunk(2, dim=-1)
    expected = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
    with torch.inference_mode():
        close(ops.act_mul(gate_up, gelu), expected, rel)


@pytest.mark.parametrize("dtype, rel", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_kv_rotates_q_and_k_and_fills_the_slots(dtype, rel, qk_norm):
    torch.manual_seed(2)
    heads, kv_heads, dim, tokens = 6, 2, 16, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    positions = torch.tensor([0, 7, 8, 30, 31])
    cos, sin = rope_cos_sin(positions, dim, 10000.0, dtype)
    key_cache, value_cache = torch.zeros(2, 10, 4, kv_heads, dim, dtype=dtype).unbind(0)
    slots = torch.tensor([3, 17, 0, 39, 22])
    q_norm, k_norm = RMSNorm(dim, 1e-6).to(dtype), RMSNorm(dim, 1e-6).to(dtype)
    q_norm.weight.data, k_norm.weight.data = torch.randn(dim).to(dtype), torch.randn(dim).to(dtype)
    norms = (q_norm.weight, k_norm.weight, 1e-6) if qk_norm else (None, None, 0.0)
    with torch.inference_mode():
        q, k = ops.rope_write_kv(qkv, cos, sin, key_cache, value_cache, slots, heads, kv_heads, *norms)
        ref_q = qkv[:, : heads * dim].view(tokens, heads, dim)
        ref_k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        if qk_norm:
            ref_q, ref_k = q_norm(ref_q), k_norm(ref_k)
        ref_v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
        close(q, apply_rope(ref_q, cos, sin), rel)
        close(k, apply_rope(ref_k, cos, sin), rel)
        assert torch.equal(key_cache.view(-1, kv_heads, dim)[slots], k)
        assert torch.equal(value_cache.view(-1, kv_heads, dim)[slots], ref_v)
        untouched = torch.ones(40, dtype=torch.bool)
        untouched[slots] = False
        assert not key_cache.view(-1, kv_heads, dim)[untouched].any()


def _paged_case(dtype, kv_heads: int, group: int, block_size: int, seed: int, dim: int = 16):
    """A step of decode rows (and one prefill chunk between them) over a cache whose pages are shuffled;
    request 1 shares request 0's first page (a prefix-cache hit); context lengths end mid-page."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 40
    key_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    pages = list(range(num_blocks))
    random.Random(seed).shuffle(pages)
    context_lens = [1, block_size + 3, 3 * block_size, 2 * block_size + 1, 5]
    spans, row = [], 0
    for i, n in enumerate(context_lens):
        table = [pages.pop() for _ in range(-(-n // block_size))]
        if i == 1:
            table[0] = spans[0].block_table[0]  # the same first page as request 0
        query_len = 4 if i == 3 else 1  # request 3: a prefill chunk among the decode rows
        spans.append(RequestSpan(row, query_len, n, table))
        row += query_len
    q = torch.randn(row, kv_heads * group, dim, generator=gen).to(dtype)
    k = torch.randn(row, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(row, kv_heads, dim, generator=gen).to(dtype)
    return q, k, v, key_cache, value_cache, spans, block_size


@pytest.mark.parametrize("dtype, rel", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("kv_heads, group", [(2, 1), (1, 3), (2, 4)])
@pytest.mark.parametrize("window, softcap", [(None, None), (6, None), (None, 5.0)])
def test_paged_decode_attention_reads_pages_in_place_as_the_gather_does(dtype, rel, kv_heads, group, window, softcap):
    q, k, v, key_cache, value_cache, spans, block_size = _paged_case(dtype, kv_heads, group, block_size=4, seed=group)
    scale = 0.25
    with torch.inference_mode():
        slot_mapping = build_attention_metadata(spans, block_size).slot_mapping
        write_kv(key_cache, value_cache, k, v, slot_mapping)
        gathered = build_attention_metadata(spans, block_size)
        in_place = attention_metadata(plan_attention(spans, block_size, in_place=True), block_size)
        assert not in_place.decodes and in_place.paged_decode.rows.tolist() == [0, 1, 2, 7]
        expected = paged_attention(q, k, v, key_cache, value_cache, gathered, scale, window, softcap)
        ours = paged_attention(q, k, v, key_cache, value_cache, in_place, scale, window, softcap)
    close(ours, expected, rel)
    # the prefill chunk's rows still come from the prefill path, identical
    assert torch.equal(ours[3:7], expected[3:7])


@pytest.mark.parametrize("dtype, rel", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("kv_heads, group, window, dim", [(2, 4, None, 16), (1, 3, 6, 16), (2, 2, None, 12)])
def test_paged_decode_attention_takes_attention_sinks_as_the_gather_does(dtype, rel, kv_heads, group, window, dim):
    """gpt-oss's sinks, one logit per query head, in the op's softmax as in the reference's (vector and scalar head
    dims, a window); large enough that dropping them moves the output well past the tolerance."""
    q, k, v, key_cache, value_cache, spans, block_size = _paged_case(dtype, kv_heads, group, block_size=4, seed=7,
                                                                     dim=dim)
    sinks = (torch.randn(kv_heads * group, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    with torch.inference_mode():
        write_kv(key_cache, value_cache, k, v, build_attention_metadata(spans, block_size).slot_mapping)
        gathered = build_attention_metadata(spans, block_size)
        in_place = attention_metadata(plan_attention(spans, block_size, in_place=True), block_size)
        expected = paged_attention(q, k, v, key_cache, value_cache, gathered, 0.25, window, None, None, sinks)
        ours = paged_attention(q, k, v, key_cache, value_cache, in_place, 0.25, window, None, None, sinks)
        unsunk = paged_attention(q, k, v, key_cache, value_cache, in_place, 0.25, window, None, None)
    close(ours, expected, rel)
    assert not torch.allclose(unsunk.float(), expected.float(), atol=0.05)


@pytest.mark.parametrize("dtype, rel", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("dim", [12, 64, 80, 128])  # no vector path; one register block; 64 + 16; two blocks
def test_paged_decode_attention_head_dims(dtype, rel, dim):
    q, k, v, key_cache, value_cache, spans, block_size = _paged_case(dtype, 1, 3, block_size=8, seed=dim, dim=dim)
    with torch.inference_mode():
        write_kv(key_cache, value_cache, k, v, build_attention_metadata(spans, block_size).slot_mapping)
        gathered = build_attention_metadata(spans, block_size)
        in_place = attention_metadata(plan_attention(spans, block_size, in_place=True), block_size)
        expected = paged_attention(q, k, v, key_cache, value_cache, gathered, 0.125, None, None)
        ours = paged_attention(q, k, v, key_cache, value_cache, in_place, 0.125, None, None)
    close(ours, expected, rel)


def test_paged_decode_attention_names_a_page_outside_the_cache():
    q, _, _, key_cache, value_cache, spans, block_size = _paged_case(torch.float32, 2, 2, block_size=4, seed=0)
    spans = [span for span in spans if span.query_len == 1]
    rows = torch.tensor([span.query_start for span in spans])
    tables = torch.tensor([span.block_table[:1] + [0] * 2 for span in spans])
    tables[1, 0] = 99
    with pytest.raises(RuntimeError, match="page 99 outside the cache of 40"):
        ops.paged_decode_attention(q, key_cache, value_cache, rows, tables, torch.tensor([1, 2, 3, 4]), 1.0, 0, 0.0,
                                   torch.empty_like(q))
    with pytest.raises(RuntimeError, match="context 13 of row 1 does not fit its 3 pages of 4"):
        ops.paged_decode_attention(q, key_cache, value_cache, rows, tables.clamp(max=5), torch.tensor([1, 13, 3, 4]),
                                   1.0, 0, 0.0, torch.empty_like(q))


def test_rope_write_kv_names_a_slot_outside_the_cache():
    qkv = torch.randn(2, (2 + 2) * 8)
    cos, sin = rope_cos_sin(torch.tensor([0, 1]), 8, 10000.0, torch.float32)
    key_cache = value_cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="slot 8 of row 1 outside the cache \\(8 slots\\)"):
        ops.rope_write_kv(qkv, cos, sin, key_cache, value_cache.clone(), torch.tensor([0, 8]), 2, 1, None, None, 0.0)
