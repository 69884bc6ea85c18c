"""Group-quantized weights: GGUF blocks mapped exactly, the compiled CPU op against the torch reference,
and a quantized tiny GGUF running as it is stored with the same logits as its dequantized twin."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.tiny_gguf import quantized_blocks, write_converter_gguf
from tests.helpers.tiny_models import make_tiny_hf_model
from tests.worker.loader.test_gguf_loader import all_row_logits, max_rel_err
from worker.linears.group_quant import (GEMM_ROWS, GroupQuantEmbedding, GroupQuantLinear, GroupQuantWeight, quantize_weight, weight_formats)
from worker.loader import load_model
from worker.loader.gguf_quants import SUPPORTED_TYPES, group_quant_from_gguf
from worker.native_ops import cpu_ops_available

needs_ops = pytest.mark.skipif(not cpu_ops_available(), reason="compiled CPU ops not built (scripts/build_cpu_ops.py)")


class _RawTensor:
    """What gguf's reader hands the loader: name, type, shape innermost-first, raw bytes."""

    def __init__(self, type_name: str, raw: np.ndarray, out_features: int, in_features: int) -> None:
        import gguf

        self.name, self.tensor_type, self.data = "blk.0.ffn_up.weight", gguf.GGMLQuantizationType[type_name], raw
        self.shape = np.array([in_features, out_features])


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_every_gguf_format_maps_onto_group_quant_bit_for_bit(type_name):
    from gguf.quants import dequantize

    values = np.random.default_rng(1).normal(size=(6, 512)).astype(np.float32)
    raw = quantized_blocks(values, type_name, seed=3)
    weight = group_quant_from_gguf(_RawTensor(type_name, raw, 6, 512))
    assert weight is not None and weight.source == type_name
    reference = torch.from_numpy(dequantize(raw, _RawTensor(type_name, raw, 6, 512).tensor_type).reshape(6, 512))
    assert torch.equal(weight.dequantize(), reference)  # exact: the file's weights, not a re-quantization
    # the layouts a fused projection converts to keep the weights exactly
    assert torch.equal(weight.with_layout(8, 16).dequantize(), reference)


def test_float_tensors_are_not_taken_for_quantized_ones():
    assert group_quant_from_gguf(_RawTensor("F32", np.zeros((2, 32), np.float32), 2, 32)) is None


@needs_ops
@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 32), (8, 16)])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, GEMM_ROWS, GEMM_ROWS + 1, 40])
def test_compiled_op_matches_the_torch_reference(bits, group_size, rows):
    torch.manual_seed(rows)
    weight = quantize_weight(torch.randn(300, 192), bits, group_size)  # 300: strips and tasks end unevenly
    bias = torch.randn(300)
    x = torch.randn(rows, 192)
    reference = x @ weight.dequantize().T + bias
    ours = GroupQuantLinear(weight, bias)(x)
    assert (ours - reference).abs().max().item() <= 1e-4 * reference.abs().max().item()
    assert torch.equal(torch.ops.tokenmill.group_quant_dequantize(weight.codes, weight.scales, weight.mins, bits, group_size),
                       weight.dequantize())


@needs_ops
@pytest.mark.parametrize("bits,group_size,in_features", [(4, 32, 192), (8, 32, 192), (8, 16, 208), (8, 48, 240)])
def test_row_kernel_avx512_and_avx2_paths_both_match_the_reference(bits, group_size, in_features):
    """The row kernel (up to GEMM_ROWS rows) takes AVX-512 where the CPU has it; AVX2 elsewhere, or when
    turned off. Both compute scale * code then a fused multiply-add: only the order of the sums differs.
    8-bit groups of 16 and 48 leave 16 codes past the AVX-512 loop's steps of 32."""
    torch.manual_seed(group_size)
    weight = quantize_weight(torch.randn(101, in_features), bits, group_size)
    linear = GroupQuantLinear(weight)
    has_avx512 = "avx512f" in Path("/proc/cpuinfo").read_text()
    try:
        for rows in (1, 2, 3, 4, 5, GEMM_ROWS):
            x = torch.randn(rows, in_features)
            reference = (x.double() @ weight.dequantize().double().T).float()
            for allowed in (False, True):  # the op answers which path it now takes
                assert torch.ops.tokenmill.group_quant_rows_avx512(allowed) == (allowed and has_avx512)
                ours = linear(x)
                assert (ours - reference).abs().max().item() <= 1e-5 * reference.abs().max().item()
    finally:
        torch.ops.tokenmill.group_quant_rows_avx512(True)


@needs_ops
@pytest.mark.parametrize("bits,group_size,in_features",
                         [(4, 32, 192), (4, 32, 544), (8, 32, 192), (8, 32, 544), (8, 16, 208), (8, 48, 240)])
def test_bfloat16_rows_sum_exact_products_and_round_once(bits, group_size, in_features):
    """Up to GEMM_ROWS rows, bfloat16 x goes into the row op as it is and comes back bfloat16: through the
    avx512_bf16 kernel (codes as bfloat16, one dot instruction per 32 weights, the scale per group) where
    the CPU has it, else the float32 kernel on the same values. Either way each product is exact and only
    the float32 sums' order and the one rounding of the output differ from the exact sum (2**-8 relative).
    544 = 17 groups of 32: an odd group count (4-bit pairs of groups, the minimums' masked tail); 8-bit
    groups of 16 and 48 leave 16 codes past the steps of 32."""
    torch.manual_seed(in_features + bits)
    weight = quantize_weight(torch.randn(101, in_features), bits, group_size)
    bias = torch.randn(101).bfloat16()
    linear = GroupQuantLinear(weight, bias)
    exact_weight = weight.scales.double().repeat_interleave(group_size, 1) * weight.unpacked_codes().double() \
        + weight.mins.double().repeat_interleave(group_size, 1)
    try:
        for rows in range(1, GEMM_ROWS + 1):
            x = torch.randn(rows, in_features).bfloat16()
            reference = x.double() @ exact_weight.T
            with_bias = reference + bias.double()
            results = []
            for allowed in (True, False):  # the AVX-512 kernels, then the AVX2 float32 one
                torch.ops.tokenmill.group_quant_rows_avx512(allowed)
                ours = torch.ops.tokenmill.group_quant_linear(x, weight.codes, weight.scales, weight.mins, bits,
                                                              group_size)
                assert ours.dtype is torch.bfloat16 and ours.shape == (rows, 101)
                assert (ours.double() - reference).abs().max().item() <= 2**-8 * reference.abs().max().item()
                results.append(ours)
                module_out = linear(x)
                assert module_out.dtype is torch.bfloat16
                assert (module_out.double() - with_bias).abs().max().item() <= 2**-7 * with_bias.abs().max().item()
            # both paths agree to bfloat16's last place
            assert (results[0].double() - results[1].double()).abs().max().item() <= \
                2**-7 * reference.abs().max().item()
    finally:
        torch.ops.tokenmill.group_quant_rows_avx512(True)


@needs_ops
@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 16)])
def test_bfloat16_strips_multiply_the_rounded_weights_in_bfloat16(bits, group_size):
    torch.manual_seed(bits)
    weight = quantize_weight(torch.randn(300, 192), bits, group_size)
    x = torch.randn(GEMM_ROWS + 5, 192).bfloat16()
    rounded = weight.dequantize().bfloat16()  # each weight rounded once from its float32 value
    ours = torch.ops.tokenmill.group_quant_linear_strips(x, weight.codes, weight.scales, weight.mins, bits,
                                                         group_size, 64)
    assert ours.dtype is torch.bfloat16
    reference = x.double() @ rounded.double().T  # the same bfloat16 operands, summed exactly
    # only the sums' float32 order and the output's one rounding to bfloat16 differ (2**-8 relative)
    assert (ours.double() - reference).abs().max().item() <= 2**-8 * reference.abs().max().item()
    # rows of the identity read the strips' weights back exactly: rounded to nearest even, as torch rounds
    basis = torch.eye(192, dtype=torch.bfloat16)
    read_back = torch.ops.tokenmill.group_quant_linear_strips(basis, weight.codes, weight.scales, weight.mins, bits,
                                                              group_size, 64)
    assert torch.equal(read_back, rounded.T)
    through_module = GroupQuantLinear(weight)(x)
    assert through_module.dtype is torch.bfloat16
    assert (through_module.double() - reference).abs().max().item() <= 2**-8 * reference.abs().max().item()


@needs_ops
def test_compiled_op_names_a_bad_layout():
    weight = quantize_weight(torch.randn(8, 64), 4)
    with pytest.raises(RuntimeError, match="in_features 48 is not a multiple of group_size 32"):
        torch.ops.tokenmill.group_quant_linear(torch.randn(1, 48), weight.codes, weight.scales, weight.mins, 4, 32)
    with pytest.raises(RuntimeError, match="group_size 16 is not supported for 4-bit codes"):
        torch.ops.tokenmill.group_quant_linear(torch.randn(1, 64), weight.codes, weight.scales, weight.mins, 4, 16)


@pytest.mark.parametrize("bits,bound", [(8, 0.005), (4, 0.1)])
def test_quantizing_at_load_rounds_to_the_nearest_code(bits, bound):
    weight = torch.randn(64, 256)
    quantized = quantize_weight(weight, bits)
    error = (quantized.dequantize() - weight).abs()
    # round to nearest: never more than half a step of the group's scale
    step = quantized.scales.repeat_interleave(32, dim=1)
    assert (error <= step / 2 + 1e-6).all()
    assert (error.norm() / weight.norm()).item() < bound


def test_concatenated_rows_keep_every_part_exact():
    parts = [quantize_weight(torch.randn(16, 64), 4), quantize_weight(torch.randn(8, 64), 8)]
    parts.append(GroupQuantWeight(parts[1].codes, parts[1].scales.repeat_interleave(2, 1), parts[1].mins.repeat_interleave(2, 1), 8, 16, "x"))
    fused = GroupQuantWeight.concat_rows(parts)
    assert (fused.bits, fused.group_size) == (8, 16)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


TYPES_BY_TENSOR = {  # a Q4_K_M-like mix: fused q/k/v and gate/up hold different formats
    "attn_q.weight": "Q4_K", "attn_k.weight": "Q5_0", "attn_v.weight": "Q6_K", "attn_output.weight": "Q4_1",
    "ffn_gate.weight": "Q5_K", "ffn_up.weight": "Q8_0", "ffn_down.weight": "Q6_K", "output.weight": "Q8_0",
}


@pytest.mark.parametrize("flavour", ["llama", "qwen2"])  # llama: q/k rows un-permuted on the codes; qwen2: biases, tied
def test_quantized_gguf_runs_as_stored_with_its_dequantized_logits(tmp_path, flavour):
    _, hf_model = make_tiny_hf_model(tmp_path, flavour, hidden_size=256, intermediate_size=256, head_dim=64)
    path = tmp_path / "tiny-q.gguf"
    write_converter_gguf(path, hf_model, quantize=TYPES_BY_TENSOR | {"token_embd.weight": "Q8_0"})
    reference, _ = load_model(path, progress=False)  # every tensor dequantized to float32
    quantized, config = load_model(path, progress=False, keep_quantized=True)
    linears = [m for m in quantized.modules() if isinstance(m, GroupQuantLinear)]
    assert len(linears) == 2 * 4 + 1  # per layer wqkv, wo, w_gate_up, w_down; and lm_head
    assert not any(isinstance(m, torch.nn.Linear | torch.nn.Embedding) for m in quantized.modules())
    assert isinstance(quantized.embed_tokens, GroupQuantEmbedding)  # the lookup dequantizes only its rows
    if config.tie_word_embeddings:  # qwen2: one set of codes behind the lookup and lm_head
        assert quantized.lm_head.codes is quantized.embed_tokens.codes
    assert weight_formats(quantized) == ", ".join(sorted({
        "Q4_K+Q5_0+Q6_K", "Q4_1", "Q5_K+Q8_0", "Q6_K", "Q8_0"}))
    tokens = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    assert max_rel_err(all_row_logits(quantized, config, tokens), all_row_logits(reference, config, tokens)) <= 1e-4


def int8_activation_reference(x: torch.Tensor, weight: GroupQuantWeight) -> torch.Tensor:
    """What --cpu-int8-activations computes, in torch: x rounded to int8 per block of 32 under absmax/127
    (half to even), each weight group's integer dot with its codes, the min term on the same rounded x."""
    rows, k = x.shape
    blocks = x.view(rows, k // 32, 32)
    scale = blocks.abs().amax(-1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    rounded = (torch.round(blocks * inverse[..., None]) * scale[..., None]).double()  # x as the kernel sees it
    size, n = weight.group_size, weight.out_features
    groups = rounded.view(rows, k // size, size)  # [rows, G, size]
    codes = weight.unpacked_codes().view(n, k // size, size).double()  # [N, G, size]
    dots = torch.einsum("tgk,ngk->tng", groups, codes)
    terms = weight.scales.double()[None] * dots + weight.mins.double()[None] * groups.sum(-1)[:, None]
    return terms.sum(-1).float()


@needs_ops
@pytest.mark.parametrize("rows", [1, 3, 4, 6, 33])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 32), (8, 16)])
def test_int8_activation_op_is_the_rounded_activation_product(rows, bits, group_size):
    torch.manual_seed(rows)
    weight = quantize_weight(torch.randn(101, 256), bits, group_size)  # odd rows: a weight row tile of one
    if bits == 8:  # the full code range, 0 and 255 included (|c - 128| = 128 must not overflow an int16 pair)
        weight.codes[0, :64] = torch.tensor([0, 255] * 32, dtype=torch.uint8)
    x = torch.randn(rows, 256)
    x[0, :32] = 0.0  # a block of zeros: scale 0, no division by it
    x[-1, 32:64] *= 100.0  # a block far larger than its neighbours: its own scale
    ours = torch.ops.tokenmill.group_quant_linear_int8_dot(x, weight.codes, weight.scales, weight.mins, bits,
                                                           group_size)
    expected = int8_activation_reference(x, weight)
    assert (ours - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    exact = x @ weight.dequantize().T
    assert ((ours - exact).norm() / exact.norm()).item() < 1e-2  # what rounding the activations costs


@needs_ops
def test_int8_activation_op_names_what_it_cannot_read():
    weight = quantize_weight(torch.randn(8, 128), 8, 64)
    with pytest.raises(RuntimeError, match="8-bit codes in groups of 64 are not supported"):
        torch.ops.tokenmill.group_quant_linear_int8_dot(torch.randn(2, 128), weight.codes, weight.scales,
                                                        weight.mins, 8, 64)


@needs_ops
def test_int8_activations_apply_to_the_layouts_the_kernel_reads(monkeypatch):
    from worker.linears import group_quant
    from worker.linears.group_quant import use_int8_activations

    model = torch.nn.Sequential(GroupQuantLinear(quantize_weight(torch.randn(64, 128), 4)),
                                GroupQuantLinear(quantize_weight(torch.randn(64, 128), 8, 16)),
                                GroupQuantLinear(quantize_weight(torch.randn(64, 128), 8, 64)))
    assert use_int8_activations(model) == 2
    assert [linear.int8_activations for linear in model] == [True, True, False]
    monkeypatch.setattr(group_quant, "INT8_ROWS", 4)
    few, many = torch.randn(4, 128), torch.randn(5, 128)
    for linear in model[:2]:
        assert torch.allclose(linear(few), int8_activation_reference(few, linear.weight_view()), rtol=1e-5, atol=1e-5)
        # past INT8_ROWS: the float kernels, exact to the dequantized weight
        assert torch.allclose(linear(many), many @ linear.weight_view().dequantize().T, rtol=1e-4, atol=1e-4)
    assert torch.allclose(model[2](few), few @ model[2].weight_view().dequantize().T, rtol=1e-4, atol=1e-4)
