"""Group-quantized weight-only matmul: the kernel against the float32 matmul on worker.linears.group_quant's
dequantized weight, for each container / group size, in each activation dtype; GroupQuantLinear's Triton
path likewise; inputs checked with the argument named."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.worker.kernels.tolerances import assert_close
from worker.linears.group_quant import GroupQuantLinear, GroupQuantWeight, quantize_weight
from worker.kernels.group_quant_matmul import GEMV_MAX_ROWS, LAYOUTS, group_quant_matmul, group_quant_matmul_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_OUTPUTS, IN_FEATURES = 40, 96  # N = 40: a partial column tile; K = 96: three groups of 32, six of 16


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def _weight(bits: int, group_size: int, seed: int) -> GroupQuantWeight:
    """Codes over their whole range and mins of both signs (every group's min is its smallest value)."""
    weight = quantize_weight(_randn(NUM_OUTPUTS, IN_FEATURES, seed=seed) + 0.5, bits, group_size)
    assert weight.codes.shape == (NUM_OUTPUTS, IN_FEATURES * bits // 8) and weight.unpacked_codes().max() == 2**bits - 1
    return weight


def _reference(x: torch.Tensor, weight: GroupQuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """float32, unrounded: the same rounded inputs times worker.linears.group_quant's dequantized weight."""
    return F.linear(x.float(), weight.dequantize(), None if bias is None else bias.float())


@pytest.mark.parametrize("bits,group_size", LAYOUTS)
def test_torch_reference_equals_a_matmul_with_the_dequantized_weight(bits, group_size):
    weight = _weight(bits, group_size, seed=1)
    x, bias = _randn(5, IN_FEATURES, seed=2), _randn(NUM_OUTPUTS, seed=3)

    out = group_quant_matmul_torch(x, weight.codes, weight.scales, weight.mins, bits, group_size, bias)

    assert torch.equal(out, _reference(x, weight, bias))


@pytest.mark.parametrize("bits,group_size", LAYOUTS)
@pytest.mark.parametrize("dtype,num_rows", [(torch.float32, 1), (torch.float16, 7), (torch.bfloat16, 19)])
def test_kernel_matches_the_dequantized_matmul_on_strided_rows(bits, group_size, dtype, num_rows):
    weight = _weight(bits, group_size, seed=4)
    x = _randn(num_rows, 2 * IN_FEATURES, seed=num_rows).to(dtype)[:, :IN_FEATURES]  # row stride 2K: a view
    assert x.stride(0) == 2 * IN_FEATURES
    bias = _randn(NUM_OUTPUTS, seed=5).to(dtype) if num_rows == 7 else None  # in x's dtype

    out = group_quant_matmul(x, weight.codes, weight.scales, weight.mins, bits, group_size, bias)

    assert out.dtype == dtype and out.shape == (num_rows, NUM_OUTPUTS)
    assert_close(out, _reference(x, weight, bias), dtype)


@pytest.mark.parametrize("bits,group_size", LAYOUTS)
@pytest.mark.parametrize("num_rows", [1, 3, GEMV_MAX_ROWS])
def test_gemv_kernel_steps_over_many_groups_with_a_partial_last_step(bits, group_size, num_rows):
    in_features = 11 * 32  # 11 groups of 32 (22 of 16): three steps of 4 groups (8), the last one partial
    weight = quantize_weight(_randn(NUM_OUTPUTS, in_features, seed=13) - 0.25, bits, group_size)
    x = _randn(num_rows, in_features, seed=14).to(torch.bfloat16)
    bias = _randn(NUM_OUTPUTS, seed=15)

    out = group_quant_matmul(x, weight.codes, weight.scales, weight.mins, bits, group_size, bias,
                             gemv_config=(16, 4 if group_size == 32 else 8, 2))  # 3 column tiles, the last partial

    assert_close(out, _reference(x, weight, bias), torch.bfloat16)


def _rounded_as_the_kernel_does(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight (float32) rounded to dtype and back: to nearest on CUDA; the Triton interpreter's float32 ->
    bfloat16 conversion truncates (its bit pattern's low 16 bits dropped), so there the reference does too."""
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        return (weight.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32)
    return weight.to(dtype).float()


@pytest.mark.parametrize("bits,group_size", LAYOUTS)
@pytest.mark.parametrize("dtype,num_rows", [(torch.float32, 3), (torch.float16, 17), (torch.bfloat16, 40)])
def test_dequant_kernel_steps_over_partial_k_and_row_tiles(bits, group_size, dtype, num_rows):
    """The weight tile dequantized into x's dtype, one deep dot a K step: 11 groups of 32 (22 of 16) in
    steps of 4 (8 of 16) groups, the last partial; 40 columns in tiles of 16, the last partial."""
    in_features = 11 * 32
    weight = quantize_weight(_randn(NUM_OUTPUTS, in_features, seed=16) - 0.25, bits, group_size)
    x = _randn(num_rows, 2 * in_features, seed=17).to(dtype)[:, in_features:]  # strided rows
    bias = _randn(NUM_OUTPUTS, seed=18) if num_rows != 17 else None
    groups_per_step = 4 if group_size == 32 else 8

    # what it computes: x times the dequantized weight rounded once to x's dtype (exact for float32)
    rounded = F.linear(x.float(), _rounded_as_the_kernel_does(weight.dequantize(), dtype),
                       None if bias is None else bias.float())

    out = group_quant_matmul(x, weight.codes, weight.scales, weight.mins, bits, group_size, bias, kernel="dequant",
                             dequant_config=(16, 16, groups_per_step, 2))

    assert out.dtype == dtype and out.shape == (num_rows, NUM_OUTPUTS)
    assert_close(out, rounded, dtype)
    default = group_quant_matmul(x, weight.codes, weight.scales, weight.mins, bits, group_size, bias, kernel="dequant")
    assert_close(default, rounded, dtype)
    # and what that rounding costs against the unrounded weight: about the dtype's own rounding, relative
    unrounded = _reference(x, weight, bias)
    relative = ((out.float() - unrounded).norm() / unrounded.norm()).item()
    assert relative < {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


@pytest.mark.parametrize("bits,group_size", LAYOUTS)
def test_linear_triton_path_matches_its_cpu_forward_with_a_float32_bias(bits, group_size):
    weight = _weight(bits, group_size, seed=6)
    linear = GroupQuantLinear(weight, _randn(NUM_OUTPUTS, seed=7)).to(DEVICE)  # biases are held in float32
    x = _randn(2, 3, IN_FEATURES, seed=8).to(torch.bfloat16)  # leading dims: 6 rows, odd

    out = linear.forward_triton(x)

    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, NUM_OUTPUTS)
    assert_close(out, _reference(x.reshape(6, -1), weight, linear.bias).view(2, 3, -1), torch.bfloat16)
    if DEVICE.type == "cpu":  # the compiled op (or its torch stand-in) computes the same numbers
        assert_close(out.view(6, -1), linear(x.reshape(6, -1)), torch.bfloat16)


def test_kernel_writes_into_out_and_takes_empty_batches():
    weight = _weight(4, 32, seed=9)
    x = _randn(3, IN_FEATURES, seed=10)
    out = torch.full((3, NUM_OUTPUTS), float("nan"), device=DEVICE)

    assert group_quant_matmul(x, weight.codes, weight.scales, weight.mins, 4, 32, out=out) is out
    assert_close(out, _reference(x, weight, None), torch.float32)
    empty = group_quant_matmul(x[:0], weight.codes, weight.scales, weight.mins, 4, 32)
    assert empty.shape == (0, NUM_OUTPUTS)


def test_inputs_are_validated_with_the_argument_named():
    weight = _weight(4, 32, seed=11)
    codes, scales, mins = weight.codes, weight.scales, weight.mins
    x = _randn(2, IN_FEATURES, seed=12)
    for matmul in (group_quant_matmul, group_quant_matmul_torch):
        name = matmul.__name__
        with pytest.raises(ValueError, match=rf"{name}: bits=4, group_size=16 is not a supported layout"):
            matmul(x, codes, scales, mins, 4, 16)
        with pytest.raises(ValueError, match=rf"{name}: x has 80 columns, expected a multiple of group_size 32"):
            matmul(_randn(2, 80, seed=0), codes, scales, mins, 4, 32)
        with pytest.raises(ValueError, match=rf"{name}: codes has shape \[40, 48\], expected \[\*, 96\]"):
            matmul(x, codes, scales, mins, 8, 32)  # 4-bit codes given as 8-bit ones
        with pytest.raises(ValueError, match=rf"{name}: codes has dtype torch.int8, expected torch.uint8"):
            matmul(x, codes.view(torch.int8), scales, mins, 4, 32)
        with pytest.raises(ValueError, match=rf"{name}: scales has shape \[39, 3\], expected \[40, 3\]"):
            matmul(x, codes, scales[:39], mins, 4, 32)
        with pytest.raises(ValueError, match=rf"{name}: mins has dtype torch.bfloat16, expected torch.float32"):
            matmul(x, codes, scales, mins.bfloat16(), 4, 32)
        with pytest.raises(ValueError, match=rf"{name}: bias has dtype torch.float16, expected torch.float32"):
            matmul(x, codes, scales, mins, 4, 32, torch.zeros(NUM_OUTPUTS, device=DEVICE, dtype=torch.float16))
        with pytest.raises(ValueError, match=rf"{name}: x has strides \[1, 2\], expected stride 1 in its last dim"):
            matmul(_randn(IN_FEATURES, 2, seed=0).T, codes, scales, mins, 4, 32)
    with pytest.raises(ValueError, match=r"group_quant_matmul: kernel='fast', expected 'auto', 'tiled' or 'dequant'"):
        group_quant_matmul(x, codes, scales, mins, 4, 32, kernel="fast")
