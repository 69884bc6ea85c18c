"""The fused-MoE kernels against a per-token reference (fused_moe_torch: each token's top-k experts one at a time in
float32 torch) and against the reference model's grouped experts (worker.model.moe.run_experts): several expert
counts, top-k and token counts (T = 1 included), an expert no token chose (its weights NaN: never read), routing
ties, a run longer than one block, strided rows, float32 / float16 / bfloat16; group-quantized experts in each
layout group_quant_matmul takes; the alignment's layout; argument errors named. Tiny shapes: under the interpreter
every launch costs a fraction of a second."""
from __future__ import annotations

import pytest
import torch

from worker.kernels.fused_moe import GroupQuantExperts, align_pairs, block_sizes, fused_moe, fused_moe_torch
from worker.kernels.group_quant_matmul import LAYOUTS
from worker.linears.group_quant import quantize_weight
from worker.model.moe import route, run_experts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HIDDEN, INTER = 48, 40  # neither a multiple of the 64-wide tiles: partial column and depth tiles
# Against the float32 reference: the kernel rounds gate/up's output and the activation to x's dtype before down
# (as the model's experts do), two roundings more than tests/worker/kernels/tolerances.py's one-output table allows;
# and the interpreter rounds float32 to bfloat16 toward zero, twice the error of a GPU's round-to-nearest
MOE_TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE)


def _experts(num_experts: int, dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [E, 2I, H], down [E, H, I]: outputs of order 1 for x of order 1."""
    return (_randn(num_experts, 2 * INTER, HIDDEN, seed=seed, scale=0.15).to(dtype),
            _randn(num_experts, HIDDEN, INTER, seed=seed + 1, scale=0.15).to(dtype))


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token (as torch.topk gives), weights in (0, 1) float32."""
    generator = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_tokens)])
    return torch.rand(num_tokens, top_k, generator=generator).to(DEVICE), experts.reshape(num_tokens, top_k).to(DEVICE)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = MOE_TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def test_alignment_pads_each_experts_run_to_whole_blocks_and_skips_experts_without_pairs():
    """The module docstring's example: experts 2 0 2 3 0 2 (3 tokens, top 2), 4 experts, blocks of 4."""
    aligned = align_pairs(torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE), num_experts=4, block_m=4)
    pad = 6  # the number of pairs
    # the bound: 6 pairs + 4 experts x 3 padding slots = 18 -> 5 blocks, whatever the routing
    assert aligned.sorted_pairs.tolist() == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad] + [pad] * 8
    assert aligned.block_experts.tolist() == [0, 2, 3, -1, -1]  # expert 1: no pair, no block


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (5, 4, 4), (9, 16, 3)])
def test_alignment_places_every_pair_once_in_a_block_of_its_expert(num_tokens, num_experts, top_k):
    weights, experts = _routing(num_tokens, num_experts, top_k, seed=num_tokens)
    block_m = 16
    aligned = align_pairs(experts, num_experts, block_m)
    num_pairs = num_tokens * top_k
    slots = aligned.sorted_pairs.view(-1, block_m)
    real = slots < num_pairs
    assert sorted(aligned.sorted_pairs[aligned.sorted_pairs < num_pairs].tolist()) == list(range(num_pairs))
    block_of_pair = aligned.block_experts[:, None].expand_as(slots)[real]
    assert torch.equal(block_of_pair.long(), experts.reshape(-1)[slots[real].long()])
    assert not real[aligned.block_experts < 0].any()  # blocks past the runs hold no pair
    used = int((aligned.block_experts >= 0).sum())
    expected_blocks = sum(-(-int(count) // block_m) for count in torch.bincount(experts.reshape(-1)).tolist())
    assert used == expected_blocks  # whole blocks per expert with pairs, none for the others


@pytest.mark.parametrize("num_tokens,num_experts,top_k,dtype", [
    (1, 8, 2, torch.float32),  # one decode token
    (7, 4, 1, torch.float32),
    (6, 6, 3, torch.float16),
    (5, 8, 2, torch.bfloat16),
    (1, 4, 4, torch.bfloat16),  # every expert chosen by the one token
])
def test_kernel_matches_the_per_token_reference(num_tokens, num_experts, top_k, dtype):
    gate_up, down = _experts(num_experts, dtype)
    x = _randn(num_tokens, HIDDEN, seed=3).to(dtype)
    weights, experts = _routing(num_tokens, num_experts, top_k, seed=4)

    out = fused_moe(x, weights, experts, gate_up, down)

    assert out.dtype == dtype and out.shape == (num_tokens, HIDDEN)
    _assert_close(out, fused_moe_torch(x, weights, experts, gate_up, down), dtype)


def test_an_expert_no_token_chose_is_never_read():
    """Expert 2's weights are NaN and no token chose it: had its tiles been read or multiplied, NaN would show."""
    gate_up, down = _experts(4, torch.float32)
    gate_up[2], down[2] = float("nan"), float("nan")
    x = _randn(6, HIDDEN, seed=5)
    experts = torch.tensor([[0, 1], [3, 0], [1, 3], [0, 3], [3, 1], [1, 0]], device=DEVICE)
    weights = torch.full((6, 2), 0.5, device=DEVICE)

    out = fused_moe(x, weights, experts, gate_up, down)

    assert torch.isfinite(out).all()
    _assert_close(out, fused_moe_torch(x, weights, experts, gate_up, down), torch.float32)


def test_routing_ties_give_the_reference_models_output():
    """Experts 1 and 3 have the same router row, so every token's probabilities for them tie: route() (the one
    routing both paths share) picks by topk's order, and the fused kernel runs what it picked as the reference
    model's grouped experts do."""
    num_experts, top_k = 4, 2
    router = _randn(num_experts, HIDDEN, seed=6, scale=0.1)
    router[3] = router[1]
    x = _randn(5, HIDDEN, seed=7)
    x[4] = x[0]  # two identical tokens too: same pairs, same outputs
    weights, experts = route(x, router, top_k, norm_topk_prob=True, weights_float=True)
    gate_up, down = _experts(num_experts, torch.float32)

    out = fused_moe(x, weights, experts, gate_up, down)

    _assert_close(out, run_experts(x, weights, experts, gate_up, down), torch.float32)
    assert torch.equal(out[4], out[0])


def test_a_run_longer_than_one_block_on_strided_rows():
    """40 tokens on 2 experts, top 2: 40 pairs per expert take two blocks each; x's rows are a strided view."""
    num_tokens = 40
    gate_up, down = _experts(2, torch.float32)
    x = _randn(num_tokens, 2 * HIDDEN, seed=8)[:, :HIDDEN]
    assert x.stride(0) == 2 * HIDDEN and block_sizes(2 * num_tokens, 2)[0] < num_tokens
    experts = torch.tensor([[0, 1]] * num_tokens, device=DEVICE)
    weights = _randn(num_tokens, 2, seed=9).abs()

    out = fused_moe(x, weights, experts, gate_up, down)

    _assert_close(out, fused_moe_torch(x, weights, experts, gate_up, down), torch.float32)


def test_gelu_tanh_experts_and_router_weights_in_the_models_dtype():
    gate_up, down = _experts(4, torch.bfloat16)
    x = _randn(3, HIDDEN, seed=10).bfloat16()
    weights, experts = _routing(3, 4, 2, seed=11)
    weights = weights.bfloat16()  # router_weights_float off: the weights in the model's dtype

    out = fused_moe(x, weights, experts, gate_up, down, hidden_act="gelu_tanh")

    _assert_close(out, fused_moe_torch(x, weights, experts, gate_up, down, "gelu_tanh"), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_gpt_oss_biases_and_clamped_swiglu_match_the_references(dtype, num_tokens):
    """gpt-oss's experts: a bias on each matmul (added before the routing weight) and the clamped SwiGLU, against the
    per-token reference and the model's own grouped experts (worker.model.moe.expert_matmuls); a limit of 1.5 and
    biases of order 1 so the clamps and the biases both move the output."""
    from worker.model.moe import expert_matmuls, run_grouped

    gate_up, down = (w * 2 for w in _experts(4, torch.float32))
    gate_up_bias, down_bias = _randn(4, 2 * INTER, seed=20), _randn(4, HIDDEN, seed=21)
    x = _randn(num_tokens, HIDDEN, seed=22)
    weights, experts = _routing(num_tokens, 4, 2, seed=23)
    swiglu = (1.5, 1.702)
    args = [t.to(dtype) for t in (x, weights, gate_up, down, gate_up_bias, down_bias)]
    x_d, weights_d, gate_up_d, down_d, gate_up_bias_d, down_bias_d = args

    out = fused_moe(x_d, weights_d, experts, gate_up_d, down_d, gate_up_bias=gate_up_bias_d, down_bias=down_bias_d,
                    swiglu=swiglu)

    reference = fused_moe_torch(x_d, weights_d, experts, gate_up_d, down_d, gate_up_bias=gate_up_bias_d,
                                down_bias=down_bias_d, swiglu=swiglu)
    _assert_close(out, reference, dtype)
    model = run_grouped(x, weights, experts, 4, lambda rows, counts: expert_matmuls(
        rows, counts, gate_up, down, "silu", gate_up_bias, down_bias, swiglu))
    _assert_close(fused_moe_torch(x, weights, experts, gate_up, down, gate_up_bias=gate_up_bias, down_bias=down_bias,
                                  swiglu=swiglu), model, torch.float32)
    plain = fused_moe_torch(x_d, weights_d, experts, gate_up_d, down_d)
    unclamped = fused_moe_torch(x_d, weights_d, experts, gate_up_d, down_d, gate_up_bias=gate_up_bias_d,
                                down_bias=down_bias_d, swiglu=(1e9, 1.702))
    assert not torch.allclose(reference, plain, atol=0.1) and not torch.allclose(reference, unclamped, atol=0.1)


def _quantized(weight: torch.Tensor, bits: int, group_size: int) -> GroupQuantExperts:
    """Each expert's [N, K] quantized as worker.linears.group_quant quantizes one linear, stacked."""
    parts = [quantize_weight(expert, bits, group_size) for expert in weight]
    return GroupQuantExperts(*(torch.stack([getattr(part, name) for part in parts])
                               for name in ("codes", "scales", "mins")), bits, group_size)


@pytest.mark.parametrize("bits,group_size", LAYOUTS)
@pytest.mark.parametrize("dtype,num_tokens", [(torch.float32, 1), (torch.bfloat16, 6)])
def test_group_quantized_experts_match_the_reference_on_their_dequantized_weights(bits, group_size, dtype,
                                                                                   num_tokens):
    """hidden 96: three groups of 32 (six of 16), a K loop of two steps with a partial one; expert width 32."""
    hidden, inter, num_experts = 96, 32, 4
    generator = torch.Generator().manual_seed(bits + group_size)
    gate_up = _quantized(torch.randn(num_experts, 2 * inter, hidden, generator=generator) * 0.1, bits, group_size)
    down = _quantized(torch.randn(num_experts, hidden, inter, generator=generator) * 0.2, bits, group_size)
    gate_up, down = (GroupQuantExperts(*(t.to(DEVICE) for t in (w.codes, w.scales, w.mins)), bits, group_size)
                     for w in (gate_up, down))
    x = torch.randn(num_tokens, hidden, generator=generator).to(DEVICE, dtype)
    weights, experts = _routing(num_tokens, num_experts, 2, seed=14)

    out = fused_moe(x, weights, experts, gate_up, down)

    assert out.dtype == dtype and out.shape == (num_tokens, hidden)
    _assert_close(out, fused_moe_torch(x, weights, experts, gate_up, down), dtype)


def test_no_tokens_give_an_empty_output():
    gate_up, down = _experts(4, torch.float32)
    empty = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    out = fused_moe(torch.empty(0, HIDDEN, device=DEVICE), empty.float(), empty, gate_up, down)
    assert out.shape == (0, HIDDEN)


def test_bad_arguments_are_named():
    gate_up, down = _experts(4, torch.float32)
    x = _randn(2, HIDDEN, seed=12)
    weights, experts = _routing(2, 4, 2, seed=13)
    with pytest.raises(ValueError, match="fused_moe: gate_up has dtype torch.float16, expected torch.float32 \\(x's"):
        fused_moe(x, weights, experts, gate_up.half(), down)
    with pytest.raises(ValueError, match="fused_moe: down has shape \\[4, 48, 20\\], expected \\[4, 48, 40\\]"):
        fused_moe(x, weights, experts, gate_up, down[:, :, :20])
    with pytest.raises(ValueError, match="fused_moe: top_experts chooses 5 experts per token, more than the 4"):
        fused_moe(x, torch.ones(2, 5, device=DEVICE), torch.zeros(2, 5, dtype=torch.int64, device=DEVICE),
                  gate_up, down)
    with pytest.raises(ValueError, match="fused_moe: hidden_act='relu' is not one of"):
        fused_moe(x, weights, experts, gate_up, down, hidden_act="relu")
    with pytest.raises(ValueError, match="fused_moe: gate_up is quantized in groups of 32, which do not divide its "
                                         "rows of 48"):
        fused_moe(x, weights, experts, _quantized(gate_up[:, :, :32], 4, 32), down)
