"""Mixtures of experts (qwen3_moe, mixtral, olmoe) against transformers: tiny random models from Hugging Face
folders through the ModelRunner's mixed prefill/decode/prefix-hit scenario (test_model_parity.run_scenario), on
the plain-torch reference and on the compiled decoder ops, float32 logits within 1e-4 of transformers (relative,
as the dense families, and absolute), greedy tokens equal to transformers' argmax.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_models import MOE_FLAVOURS, make_tiny_hf_model
from tests.worker.model.test_model_parity import MAX_REL_ERR, run_scenario
from worker.loader import load_model
from worker.model.moe import SparseMoE

MAX_ABS_ERR = 1e-4
PROMPT_LENS = {"A": 37, "B": 25, "C": 45, "D": 37}


@pytest.fixture(scope="module", params=MOE_FLAVOURS)
def tiny_moe(request, tmp_path_factory):
    folder, hf_model = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), request.param)
    model, config = load_model(folder, progress=False)
    return hf_model, model, config


def max_abs_diff(builder, rows, hf_model) -> float:
    """The largest |ours - transformers| over every computed row's logits; asserts the relative bound too."""
    with torch.no_grad():
        reference = {rid: hf_model(torch.tensor([tokens])).logits[0] for rid, tokens in builder.tokens.items()}
    worst = 0.0
    for request_id, position, ours in rows:
        expected = reference[request_id][position]
        rel_err = ((ours - expected).norm() / expected.norm()).item()
        assert rel_err <= MAX_REL_ERR, f"{request_id} position {position}: relative error {rel_err:.2e}"
        worst = max(worst, (ours - expected).abs().max().item())
    for request_id, tokens in builder.tokens.items():  # greedy: every generated token is transformers' argmax
        start = PROMPT_LENS[request_id]
        assert tokens[start:] == reference[request_id][start - 1 : len(tokens) - 1].argmax(-1).tolist(), request_id
    return worst


@pytest.mark.parametrize("fused", [False, True])
def test_moe_logits_and_greedy_match_transformers(tiny_moe, fused):
    hf_model, model, config = tiny_moe
    assert config.num_experts == 8 and any(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    builder, rows = run_scenario(model, config, block_size=16, fused=fused)
    worst = max_abs_diff(builder, rows, hf_model)
    print(f"{config.architecture} fused={fused}: max |logit diff| vs transformers {worst:.3e}")
    assert worst <= MAX_ABS_ERR


def test_qwen3_moe_keeps_its_dense_layers(tiny_moe):
    hf_model, model, config = tiny_moe
    if config.architecture != "qwen3_moe":
        pytest.skip("mlp_only_layers is Qwen3-MoE's")
    assert config.dense_mlp_layers == (1,)
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["SparseMoE", "MLP", "SparseMoE"]
