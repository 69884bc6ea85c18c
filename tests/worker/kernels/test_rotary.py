"""The rotary kernel against worker.model.llama.apply_rope, on q / k views of one fused qkv output as the model
has them, with the cos / sin tables worker.model.rope_cos_sin builds."""
from __future__ import annotations

import pytest
import torch

from tests.worker.kernels.tolerances import assert_close
from worker.kernels.rotary import apply_rotary
from worker.model.llama import apply_rope, rope_cos_sin

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
THETA = 10000.0


def _fused_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """qkv: [T, (H + 2 * KVH) * D] and its q [T, H, D], k [T, KVH, D], v [T, KVH, D] views (strided rows)."""
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens, num_heads, num_kv_heads, head_dim",
    [(1, 4, 4, 32), (7, 6, 2, 48), (33, 8, 1, 64)],  # GQA ratios 1, 3, 8; D / 2 = 24 is not a power of two
)
def test_rotates_q_and_k_in_place_like_the_model(dtype, num_tokens, num_heads, num_kv_heads, head_dim):
    _, q, k, v = _fused_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=num_tokens)
    # packed batch: each token has its own position, in no particular order
    positions = torch.randint(0, 4096, (num_tokens,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    cos, signed_sin = rope_cos_sin(positions, head_dim, THETA, dtype)  # [T, 1, D] each, as the model has them
    expected_q = apply_rope(q.float(), cos.float(), signed_sin.float())
    expected_k = apply_rope(k.float(), cos.float(), signed_sin.float())
    v_before = v.clone()

    returned_q, returned_k = apply_rotary(q, k, cos, signed_sin)

    assert returned_q is q and returned_k is k
    assert_close(q, expected_q, dtype)
    assert_close(k, expected_k, dtype)
    torch.testing.assert_close(v, v_before, atol=0, rtol=0)  # the neighbouring v columns are not touched


def test_accepts_two_dimensional_tables():
    _, q, k, _ = _fused_qkv(5, 2, 1, 32, torch.float32, seed=2)
    cos, signed_sin = rope_cos_sin(torch.arange(5, device=DEVICE), 32, THETA, torch.float32)
    expected_q = apply_rope(q.clone(), cos, signed_sin)
    expected_k = apply_rope(k.clone(), cos, signed_sin)

    apply_rotary(q, k, cos.squeeze(1), signed_sin.squeeze(1))

    assert_close(q, expected_q, torch.float32)
    assert_close(k, expected_k, torch.float32)


def test_inputs_are_validated_with_the_argument_named():
    _, q, k, _ = _fused_qkv(3, 4, 2, 32, torch.float32, seed=3)
    cos, signed_sin = rope_cos_sin(torch.arange(3, device=DEVICE), 32, THETA, torch.float32)
    with pytest.raises(ValueError, match=r"apply_rotary: query has head_dim 31, expected an even number"):
        apply_rotary(torch.zeros(3, 4, 31, device=DEVICE), k, cos, signed_sin)
    with pytest.raises(ValueError, match=r"apply_rotary: key has shape \[3, 2, 16\], expected \[3, \*, 32\]"):
        apply_rotary(q, torch.zeros(3, 2, 16, device=DEVICE), cos, signed_sin)
    with pytest.raises(ValueError, match=r"apply_rotary: key has dtype torch.float16, expected torch.float32"):
        apply_rotary(q, k.half(), cos, signed_sin)
    with pytest.raises(ValueError, match=r"apply_rotary: cos has shape \[4, 1, 32\], expected \[3, 1, 32\]"):
        apply_rotary(q, k, torch.zeros(4, 1, 32, device=DEVICE), signed_sin)
    with pytest.raises(ValueError, match=r"apply_rotary: signed_sin has shape \[3, 16\], expected \[3, 32\]"):
        apply_rotary(q, k, cos, torch.zeros(3, 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"apply_rotary: query has strides .*, expected stride 1 in its last dim"):
        apply_rotary(torch.zeros(3, 32, 4, device=DEVICE).transpose(1, 2), k, cos, signed_sin)
