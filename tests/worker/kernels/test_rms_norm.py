"""RMSNorm kernels against worker.model.llama.RMSNorm run in float32 (the interpreter on CPU, CUDA on a GPU)."""
from __future__ import annotations

import pytest
import torch

from tests.worker.kernels.tolerances import assert_close
from worker.kernels.rms_norm import fused_add_rms_norm, rms_norm
from worker.model.llama import RMSNorm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6


def _reference_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The model's own module, in float32 on float32 copies."""
    norm = RMSNorm(x.shape[1], EPS).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(weight.float())
        return norm(x.float())


def _strided_rows(num_tokens: int, hidden_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, hidden] view with row stride 2 * hidden: the left half of a wider buffer."""
    generator = torch.Generator().manual_seed(seed)
    wide = torch.randn(num_tokens, 2 * hidden_size, generator=generator) * 2
    return wide.to(DEVICE, dtype)[:, :hidden_size]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, hidden_size", [(1, 96), (7, 64), (33, 96)])
def test_rms_norm_matches_the_model_norm(dtype, num_tokens, hidden_size):
    x = _strided_rows(num_tokens, hidden_size, dtype, seed=num_tokens)
    assert x.stride(0) == 2 * hidden_size  # rows are strided
    weight = (torch.rand(hidden_size, generator=torch.Generator().manual_seed(1)) + 0.5).to(DEVICE, dtype)

    out = rms_norm(x, weight, EPS)

    assert out.dtype == dtype and out.shape == (num_tokens, hidden_size)
    assert_close(out, _reference_norm(x, weight), dtype)


def test_rms_norm_writes_into_out():
    x = _strided_rows(5, 96, torch.float32, seed=2)
    weight = torch.ones(96, device=DEVICE)
    out = torch.full((5, 96), float("nan"), device=DEVICE)

    returned = rms_norm(x, weight, EPS, out=out)

    assert returned is out
    assert_close(out, _reference_norm(x, weight), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 33])
def test_fused_add_rms_norm_returns_the_norm_of_the_sum_and_the_sum(dtype, num_tokens):
    x = _strided_rows(num_tokens, 96, dtype, seed=3)
    residual = torch.randn(num_tokens, 96, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    weight = (torch.rand(96, generator=torch.Generator().manual_seed(5)) + 0.5).to(DEVICE, dtype)

    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)

    # the sum is rounded to the activation dtype, exactly as the unfused `h = x + attn(...)`; the
    # interpreter rounds float32 -> bfloat16 by truncation, so there bf16 is only within tolerance
    expected_residual = x + residual
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        assert_close(new_residual, x.float() + residual.float(), dtype)
    else:
        torch.testing.assert_close(new_residual, expected_residual, atol=0, rtol=0)
    assert_close(normed, _reference_norm(expected_residual, weight), dtype)


def test_fused_add_rms_norm_updates_the_residual_in_place():
    x = _strided_rows(7, 96, torch.float16, seed=6)
    residual = torch.randn(7, 96, generator=torch.Generator().manual_seed(7)).to(DEVICE, torch.float16)
    weight = torch.ones(96, device=DEVICE, dtype=torch.float16)
    expected_residual = x + residual

    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS, residual_out=residual)

    assert new_residual is residual
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    assert_close(normed, _reference_norm(expected_residual, weight), torch.float16)


def test_inputs_are_validated_with_the_argument_named():
    x = torch.zeros(4, 96, device=DEVICE)
    weight = torch.ones(96, device=DEVICE)
    with pytest.raises(ValueError, match=r"rms_norm: weight has shape \[64\], expected \[96\]"):
        rms_norm(x, torch.ones(64, device=DEVICE), EPS)
    with pytest.raises(ValueError, match=r"rms_norm: weight has dtype torch.float16, expected torch.float32"):
        rms_norm(x, weight.half(), EPS)
    with pytest.raises(ValueError, match=r"rms_norm: x has shape \[2, 2, 96\], expected \[\*, \*\]"):
        rms_norm(x.view(2, 2, 96), weight, EPS)
    with pytest.raises(ValueError, match=r"rms_norm: x has dtype torch.int64"):
        rms_norm(x.long(), weight, EPS)
    with pytest.raises(ValueError, match=r"rms_norm: x has strides \[1, 4\], expected stride 1 in its last dim"):
        rms_norm(torch.zeros(96, 4, device=DEVICE).t(), weight, EPS)
    with pytest.raises(ValueError, match=r"fused_add_rms_norm: residual has shape \[3, 96\], expected \[4, 96\]"):
        fused_add_rms_norm(x, torch.zeros(3, 96, device=DEVICE), weight, EPS)
    with pytest.raises(ValueError, match=r"fused_add_rms_norm: residual_out has dtype torch.float16"):
        fused_add_rms_norm(x, x.clone(), weight, EPS, residual_out=x.half())
