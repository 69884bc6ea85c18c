"""INT8 weight-only matmul: the quantizer's error bound, the torch path against a dequantized float32
matmul, and the kernel against the torch path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.worker.kernels.tolerances import assert_close
from worker.kernels.int8_matmul import int8_weight_matmul, int8_weight_matmul_torch, quantize_int8_weight

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def test_quantization_is_symmetric_per_output_channel_within_half_a_step():
    weight = _randn(40, 96, seed=0) * torch.linspace(0.01, 5.0, 40, device=DEVICE).unsqueeze(1)  # rows of every scale
    weight[3] = 0.0

    qweight, scales = quantize_int8_weight(weight.half())

    assert qweight.dtype == torch.int8 and qweight.shape == (40, 96) and qweight.is_contiguous()
    assert scales.dtype == torch.float32 and scales.shape == (40,)
    weight = weight.half().float()
    dequantized = qweight.float() * scales.unsqueeze(1)
    assert torch.all((dequantized - weight).abs() <= scales.unsqueeze(1) / 2 * (1 + 1e-5))
    # each row's largest magnitude lands on +-127: the whole int8 range is used
    nonzero_rows = [row for row in range(40) if row != 3]
    assert torch.all(qweight[nonzero_rows].abs().amax(dim=1) == 127)
    assert torch.all(qweight[3] == 0) and scales[3] == 1.0


@pytest.mark.parametrize("with_bias", [False, True])
def test_torch_path_equals_a_matmul_with_the_dequantized_weight(with_bias):
    qweight, scales = quantize_int8_weight(_randn(40, 96, seed=1))
    x = _randn(7, 96, seed=2)
    bias = _randn(40, seed=3) if with_bias else None

    expected = F.linear(x, qweight.float() * scales.unsqueeze(1), bias)

    assert_close(int8_weight_matmul_torch(x, qweight, scales, bias), expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 7, 33])
def test_kernel_matches_the_torch_path_on_strided_rows(dtype, num_rows):
    qweight, scales = quantize_int8_weight(_randn(40, 96, seed=4))  # N = 40, K = 96: partial tiles both ways
    x = _randn(num_rows, 2 * 96, seed=num_rows).to(dtype)[:, :96]  # row stride 2K: a view, not a copy
    assert x.stride(0) == 2 * 96
    bias = _randn(40, seed=5).to(dtype) if num_rows == 7 else None

    out = int8_weight_matmul(x, qweight, scales, bias)

    assert out.dtype == dtype and out.shape == (num_rows, 40)
    # the reference multiplies the same rounded inputs in float32 and does not round the result
    expected = int8_weight_matmul_torch(x.float(), qweight, scales, bias.float() if bias is not None else None)
    assert_close(out, expected, dtype)


def test_kernel_writes_into_out():
    qweight, scales = quantize_int8_weight(_randn(24, 32, seed=6))
    x = _randn(3, 32, seed=7)
    out = torch.full((3, 24), float("nan"), device=DEVICE)

    assert int8_weight_matmul(x, qweight, scales, out=out) is out
    assert_close(out, int8_weight_matmul_torch(x, qweight, scales), torch.float32)


def test_inputs_are_validated_with_the_argument_named():
    qweight, scales = quantize_int8_weight(_randn(40, 96, seed=8))
    x = _randn(2, 96, seed=9)
    for matmul in (int8_weight_matmul, int8_weight_matmul_torch):
        name = matmul.__name__
        with pytest.raises(ValueError, match=rf"{name}: qweight has shape \[40, 96\], expected \[\*, 64\]"):
            matmul(x[:, :64], qweight, scales)
        with pytest.raises(ValueError, match=rf"{name}: qweight has dtype torch.float32, expected torch.int8"):
            matmul(x, qweight.float(), scales)
        with pytest.raises(ValueError, match=rf"{name}: scales has shape \[39\], expected \[40\]"):
            matmul(x, qweight, scales[:39])
        with pytest.raises(ValueError, match=rf"{name}: scales has dtype torch.float16, expected torch.float32"):
            matmul(x, qweight, scales.half())
        with pytest.raises(ValueError, match=rf"{name}: bias has dtype torch.float16, expected torch.float32"):
            matmul(x, qweight, scales, torch.zeros(40, device=DEVICE, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"quantize_int8_weight: weight has shape \[40\], expected \[\*, \*\]"):
        quantize_int8_weight(torch.zeros(40, device=DEVICE))
