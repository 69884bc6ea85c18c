"""Dense copies of group-quantized weights for many-row steps (worker.linears.dense_weights): the same rounded
weights as the strips, one oneDNN GEMM; few-row steps still read the codes; what auto decides; and a
quantized tiny GGUF with the copies giving its logits without them."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers.tiny_gguf import write_converter_gguf
from tests.helpers.tiny_models import make_tiny_hf_model
from tests.worker.loader.test_gguf_loader import all_row_logits, max_rel_err
from tests.worker.linears.test_group_quant import TYPES_BY_TENSOR
from worker.linears import dense_weights
from worker.linears.dense_weights import decide, dense_weights_kept, keep_dense_weights
from worker.linears.group_quant import DENSE_ROWS, INT8_ROWS, GroupQuantLinear, quantize_weight
from worker.loader import load_model
from worker.native_ops import cpu_has_native_bf16, cpu_ops_available

needs_ops = pytest.mark.skipif(not cpu_ops_available(), reason="compiled CPU ops not built (scripts/build_cpu_ops.py)")
GIB = 2**30


def quantized_linear(bits: int, group_size: int, seed: int, out_features: int = 300,
                     in_features: int = 192) -> GroupQuantLinear:
    torch.manual_seed(seed)
    return GroupQuantLinear(quantize_weight(torch.randn(out_features, in_features), bits, group_size),
                            bias=torch.randn(out_features))


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not dense_weights.onednn_bf16(), reason="oneDNN has no bfloat16 matmul on this CPU"))])
@pytest.mark.parametrize("bits,group_size", [(4, 32), (8, 16)])
def test_many_rows_multiply_the_strips_rounded_weights_in_one_gemm(dtype, bits, group_size):
    linear = quantized_linear(bits, group_size, seed=bits)
    keep_dense_weights(linear, "on", dtype)
    assert linear.dense_weight is not None
    rounded = linear.weight_view().dequantize().to(dtype)  # what the strips multiply
    for rows in (DENSE_ROWS, 32, 100):
        x = torch.randn(rows, 192).to(dtype)
        ours = linear(x)
        assert ours.dtype is dtype
        reference = x.double() @ rounded.double().T + linear.bias.double()  # the same operands, summed exactly
        # float32: only the sums' order differs; bfloat16: that and the output's rounding (2**-8 relative)
        tolerance = 1e-5 if dtype is torch.float32 else 2**-7
        assert (ours.double() - reference).abs().max().item() <= tolerance * reference.abs().max().item()


@needs_ops
def test_few_rows_still_read_the_codes_and_many_rows_read_the_copy():
    linear = quantized_linear(4, 32, seed=0)
    x_few, x_many = torch.randn(DENSE_ROWS - 1, 192), torch.randn(DENSE_ROWS, 192)
    codes_few, codes_many = linear(x_few), linear(x_many)
    keep_dense_weights(linear, "on", torch.float32)
    assert torch.equal(linear(x_few), codes_few)  # bit for bit: the row kernel on the codes
    # a zero copy shows which path ran: many rows read it (and add the bias), few rows do not
    linear.dense_weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(300, 192), None)
    assert torch.equal(linear(x_many), linear.bias.expand(DENSE_ROWS, -1))
    assert not torch.equal(codes_many, linear.bias.expand(DENSE_ROWS, -1))
    assert torch.equal(linear(x_few), codes_few)
    # an activation dtype the copy is not in takes the strips, not a copy made for another dtype
    assert linear(x_many.bfloat16()).abs().sum() > 0


@needs_ops
def test_int8_activation_rows_keep_their_kernel_beside_a_copy():
    linear = quantized_linear(4, 32, seed=1)
    linear.int8_activations = True
    x = torch.randn(INT8_ROWS, 192)
    int8_rows = linear(x)
    keep_dense_weights(linear, "on", torch.float32)
    assert torch.equal(linear(x), int8_rows)


def test_auto_keeps_copies_for_bfloat16_on_native_bfloat16_within_a_memory_share(monkeypatch):
    monkeypatch.setattr(dense_weights, "onednn_bf16", lambda: True)  # a CPU oneDNN multiplies bfloat16 on
    assert decide("off", torch.bfloat16, 1, 100 * GIB) == (False, "off (--cpu-dense-weights off)")
    assert decide("on", torch.float32, 10 * GIB, GIB)[0]  # on: whatever it costs
    keep, reason = decide("auto", torch.float32, 1, 100 * GIB)
    assert not keep and "bfloat16 models only (this one runs in float32)" in reason
    monkeypatch.setattr(dense_weights, "cpu_has_native_bf16", lambda: False)
    keep, reason = decide("auto", torch.bfloat16, 1, 100 * GIB)
    assert not keep and "natively" in reason
    monkeypatch.setattr(dense_weights, "cpu_has_native_bf16", lambda: True)
    keep, reason = decide("auto", torch.bfloat16, 270 * 2**20, 20 * GIB)
    assert keep and reason == "270 MiB, 1.3% of the 20.0 GiB available (auto)"
    keep, reason = decide("auto", torch.bfloat16, 6 * GIB, 20 * GIB)
    assert not keep and "6144 MiB, over 25% of the 20.0 GiB available" in reason
    with pytest.raises(ValueError, match="'bf16' is not one of"):
        decide("bf16", torch.bfloat16, 1, GIB)


def test_copies_are_made_once_and_dropped_by_off():
    model = nn.Sequential(quantized_linear(4, 32, seed=2), quantized_linear(8, 32, seed=3, in_features=320))
    assert keep_dense_weights(model, "on", torch.float32).startswith("2 linears, ")
    first = model[0].dense_weight
    assert dense_weights_kept(model)
    again = keep_dense_weights(model, "on", torch.float32)  # a second runner over the same model
    assert model[0].dense_weight is first and again.endswith("MiB, made already (by an earlier runner over this model)")
    assert keep_dense_weights(model, "off", torch.float32) == "off (--cpu-dense-weights off)"
    assert model[0].dense_weight is None and model[1].dense_weight is None and not dense_weights_kept(model)
    assert keep_dense_weights(nn.Linear(4, 4), "on", torch.float32) == "off: no group-quantized linears"


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="auto keeps copies only on a CPU with native bfloat16")
def test_auto_keeps_bfloat16_copies_here():
    linear = quantized_linear(4, 32, seed=4)
    assert "(auto)" in keep_dense_weights(linear, "auto", torch.bfloat16)
    assert linear.dense_weight is not None and keep_dense_weights(linear, "auto", torch.float32).startswith("off")


def test_a_quantized_gguf_with_copies_gives_its_logits_without_them(tmp_path):
    _, hf_model = make_tiny_hf_model(tmp_path, "llama", hidden_size=256, intermediate_size=256, head_dim=64)
    path = tmp_path / "tiny-q.gguf"
    write_converter_gguf(path, hf_model, quantize=TYPES_BY_TENSOR)
    model, config = load_model(path, progress=False, keep_quantized=True)
    tokens = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    without = all_row_logits(model, config, tokens)  # a 24-row prefill: the strips
    assert keep_dense_weights(model, "on", torch.float32).startswith("8 linears, ")
    # the same float32 weights summed in oneDNN's order instead of the strips': 2e-5 on an AVX-512 CPU
    # without AMX (AMD EPYC), under 1e-5 on Sapphire Rapids; a misplaced weight would be ~1e-2
    assert max_rel_err(all_row_logits(model, config, tokens), without) <= 1e-4


def test_bfloat16_copies_are_off_where_onednn_cannot_make_them(monkeypatch):
    # an AVX2-only CPU: torch's bfloat16 reorder raises there, so even `on` keeps none and says why
    monkeypatch.setattr(dense_weights, "onednn_bf16", lambda: False)
    for mode in ("on", "auto"):
        assert decide(mode, torch.bfloat16, 1, 100 * GIB) == (False, dense_weights.NO_ONEDNN_BF16)
    assert decide("on", torch.float32, 1, 100 * GIB)[0]  # float32 copies need no bfloat16
    linear = quantized_linear(4, 32, seed=4)
    assert keep_dense_weights(linear, "on", torch.bfloat16) == dense_weights.NO_ONEDNN_BF16
    assert linear.dense_weight is None
