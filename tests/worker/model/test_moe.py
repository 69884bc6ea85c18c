"""worker.model.moe against transformers' own sparse blocks and a per-token loop: routing (softmax then top-k,
renormalisation, Mixtral's float32 weights), ties between experts, and the grouped execution (each expert with
tokens once, an expert without tokens never run).
"""
from __future__ import annotations

import pytest
import torch

import worker.model.moe as moe
from worker.model.config import ModelConfig
from worker.model.moe import SparseMoE, route, run_experts

HIDDEN, INTER, EXPERTS = 64, 32, 8


def hf_block(kind: str, top_k: int, norm_topk_prob: bool = False):
    """transformers' sparse block of one family, eager experts, weights N(0, 0.1)."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(hidden_size=HIDDEN, num_experts=EXPERTS, num_experts_per_tok=top_k,
                                moe_intermediate_size=INTER, norm_topk_prob=norm_topk_prob)
        block_class = Qwen3MoeSparseMoeBlock
    elif kind == "mixtral":
        config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=EXPERTS,
                               num_experts_per_tok=top_k)
        block_class = MixtralSparseMoeBlock
    else:
        config = OlmoeConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_experts=EXPERTS,
                             num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob)
        block_class = OlmoeSparseMoeBlock
    config._experts_implementation = "eager"
    block = block_class(config).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.1)
    return block


def ours(block, kind: str, top_k: int, norm_topk_prob: bool) -> SparseMoE:
    """SparseMoE over the same weights (the loader's names: router, stacked gate/up, down)."""
    config = ModelConfig(architecture=kind, vocab_size=16, hidden_size=HIDDEN, intermediate_size=INTER, num_layers=1,
                         num_heads=4, num_kv_heads=4, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, attention_bias=False, max_position_embeddings=64,
                         bos_token_id=None, eos_token_id=None, num_experts=EXPERTS, num_experts_per_tok=top_k,
                         moe_intermediate_size=INTER, norm_topk_prob=norm_topk_prob or kind == "mixtral",
                         router_weights_float=kind == "mixtral")
    layer = SparseMoE(config)
    layer.load_state_dict({"router_weight": block.gate.weight, "experts.gate_up": block.experts.gate_up_proj,
                           "experts.down": block.experts.down_proj})
    return layer.eval()


def per_token_reference(layer: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """One token at a time: sum over its top-k experts of weight * down(silu(gate) * up)."""
    rows = []
    for token in x:
        weights, experts = route(token[None], layer.router_weight, layer.top_k, layer.norm_topk_prob, layer.weights_float)
        total = torch.zeros_like(token)
        for weight, expert in zip(weights[0], experts[0].tolist()):
            gate, up = (layer.experts.gate_up[expert] @ token).chunk(2)
            total += weight * (layer.experts.down[expert] @ (torch.nn.functional.silu(gate) * up))
        rows.append(total)
    return torch.stack(rows)


@pytest.mark.parametrize("kind, top_k, norm", [("qwen3_moe", 2, True), ("qwen3_moe", 3, False), ("mixtral", 2, False),
                                               ("olmoe", 2, False), ("olmoe", 1, True)])
def test_block_matches_transformers_and_a_per_token_loop(kind, top_k, norm):
    torch.manual_seed(0)
    block = hf_block(kind, top_k, norm)
    layer = ours(block, kind, top_k, norm)
    x = torch.randn(1, 37, HIDDEN)
    with torch.no_grad():
        expected = block(x)[0]
        got = layer(x[0])
        assert (got - expected).abs().max().item() <= 1e-6
        assert (got - per_token_reference(layer, x[0])).abs().max().item() <= 1e-6


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_tied_router_logits_pick_the_expert_transformers_picks(kind):
    """Experts 2 and 5 have the same router row, so every token's logits tie between them; top-1 routes each
    token to one of the two, whose outputs differ: ours must choose as transformers' topk does."""
    torch.manual_seed(1)
    block = hf_block(kind, top_k=1)
    with torch.no_grad():
        block.gate.weight[5] = block.gate.weight[2]
    layer = ours(block, kind, 1, False)
    x = torch.randn(1, 23, HIDDEN)
    with torch.no_grad():
        logits = torch.nn.functional.linear(x[0], layer.router_weight)
        assert torch.equal(logits[:, 2], logits[:, 5]), "the router rows must tie exactly"
        _, chosen = route(x[0], layer.router_weight, 1, False, False)
        tied = (chosen[:, 0] == 2) | (chosen[:, 0] == 5)
        assert tied.any(), "some token's top expert is one of the tied pair"
        expected = block(x)[0]
        assert (layer(x[0]) - expected).abs().max().item() <= 1e-6
        # the other choice would show: expert 2 and expert 5 compute different things
        swapped = torch.where(chosen == 2, 5, torch.where(chosen == 5, 2, chosen))
        weights = torch.ones_like(chosen, dtype=x.dtype)
        other = run_experts(x[0], weights, swapped, layer.experts.gate_up, layer.experts.down)
        assert (other[tied] - expected[tied]).abs().max().item() > 1e-3


def test_an_expert_without_tokens_is_never_run(monkeypatch):
    """Expert 3's router row is far below the others and its weights are NaN: a step whose tokens all go
    elsewhere must give transformers' output (a dense or masked computation would spread the NaNs), and the
    experts run are exactly those with tokens, once each."""
    torch.manual_seed(2)
    block = hf_block("qwen3_moe", top_k=2, norm_topk_prob=True)
    x = torch.randn(1, 19, HIDDEN)
    with torch.no_grad():
        block.gate.weight[3] = -50.0 * x[0].mean(0) / x[0].mean(0).norm()
        block.experts.gate_up_proj[3] = float("nan")
        block.experts.down_proj[3] = float("nan")
    layer = ours(block, "qwen3_moe", 2, True)
    runs: list[int] = []
    activation = moe._activation
    monkeypatch.setattr(moe, "_activation", lambda gate, act: (runs.append(gate.shape[0]), activation(gate, act))[1])
    with torch.no_grad():
        _, chosen = route(x[0], layer.router_weight, 2, True, False)
        assert 3 not in chosen.tolist()
        got = layer(x[0])
        expected = block(x)[0]
    assert torch.isfinite(got).all()
    assert (got - expected).abs().max().item() <= 1e-6
    counts = torch.bincount(chosen.reshape(-1), minlength=EXPERTS).tolist()
    assert runs == [count for count in counts if count], "one run per expert with tokens, over all of them"


def test_an_empty_step_and_one_token():
    torch.manual_seed(3)
    block = hf_block("olmoe", top_k=2)
    layer = ours(block, "olmoe", 2, False)
    with torch.no_grad():
        assert layer(torch.zeros(0, HIDDEN)).shape == (0, HIDDEN)
        x = torch.randn(1, 1, HIDDEN)
        assert (layer(x[0]) - block(x)[0]).abs().max().item() <= 1e-6


def test_mixtral_top_k_then_softmax_is_the_renormalised_softmax():
    """Mixtral as first released (softmax over the k chosen logits) and as transformers 5 writes it (softmax,
    top-k, renormalise): the same experts and weights."""
    torch.manual_seed(4)
    x, router = torch.randn(31, HIDDEN), torch.randn(EXPERTS, HIDDEN)
    weights, experts = route(x, router, 2, norm_topk_prob=True, weights_float=True)
    top_logits, top_experts = torch.topk(torch.nn.functional.linear(x, router), 2, dim=-1)
    assert torch.equal(experts, top_experts)
    torch.testing.assert_close(weights, torch.softmax(top_logits, dim=-1), rtol=1e-6, atol=1e-7)
