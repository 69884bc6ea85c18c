"""silu_and_mul against the model's MLP math (F.silu(gate) * up) on halves of one gate_up output."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.worker.kernels.tolerances import assert_close
from worker.kernels.activation import silu_and_mul
from worker.model.config import ModelConfig
from worker.model.llama import MLP

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _gate_up(num_tokens: int, intermediate_size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[T, 2I], as the fused gate_up projection returns it."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, 2 * intermediate_size, generator=generator) * 3).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, intermediate_size", [(1, 40), (7, 1100), (33, 96)])  # 1100: two column blocks
def test_matches_silu_times_up_on_strided_halves(dtype, num_tokens, intermediate_size):
    gate, up = _gate_up(num_tokens, intermediate_size, dtype, seed=num_tokens).chunk(2, dim=-1)
    assert gate.stride(0) == 2 * intermediate_size  # views into the fused output, not copies

    out = silu_and_mul(gate, up)

    assert out.dtype == dtype and out.shape == (num_tokens, intermediate_size) and out.is_contiguous()
    assert_close(out, F.silu(gate.float()) * up.float(), dtype)


def test_the_model_mlp_gives_the_same_output_through_the_kernel():
    config = ModelConfig(
        architecture="llama", vocab_size=32, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        attention_bias=False, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    mlp = MLP(config).to(DEVICE)
    x = torch.randn(7, 64, device=DEVICE)

    with torch.no_grad():
        through_kernel = mlp.w_down(silu_and_mul(*mlp.w_gate_up(x).chunk(2, dim=-1)))
        assert_close(through_kernel, mlp(x), torch.float32)


def test_writes_into_out():
    gate, up = _gate_up(3, 40, torch.float32, seed=1).chunk(2, dim=-1)
    out = torch.full((3, 40), float("nan"), device=DEVICE)

    assert silu_and_mul(gate, up, out=out) is out
    assert_close(out, F.silu(gate) * up, torch.float32)


def test_inputs_are_validated_with_the_argument_named():
    gate = torch.zeros(3, 40, device=DEVICE)
    with pytest.raises(ValueError, match=r"silu_and_mul: up has shape \[3, 41\], expected \[3, 40\]"):
        silu_and_mul(gate, torch.zeros(3, 41, device=DEVICE))
    with pytest.raises(ValueError, match=r"silu_and_mul: up has dtype torch.float16, expected torch.float32"):
        silu_and_mul(gate, gate.half())
    with pytest.raises(ValueError, match=r"silu_and_mul: gate has dtype torch.int32"):
        silu_and_mul(gate.int(), gate.int())
    with pytest.raises(ValueError, match=r"silu_and_mul: out has shape \[3, 20\], expected \[3, 40\]"):
        silu_and_mul(gate, gate, out=torch.zeros(3, 20, device=DEVICE))
