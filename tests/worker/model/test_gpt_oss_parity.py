"""gpt-oss against transformers' GptOssForCausalLM on one tiny random folder (tests/helpers/tiny_models.py: 4
layers, sliding window 8 on layers 0 and 2, 4 heads on 2 KV heads, 4 experts top 2, YaRN, attention sinks, biases
everywhere, a SwiGLU limit that bites): float32 logits within 1e-4 through the ModelRunner's paged steps, for
prompts longer than the window (test_model_parity's mixed prefill / decode / prefix-hit scenario) and a prompt
shorter than it whose decode steps run past it, on the reference and on the CPU path's compiled ops (their decode
attention op on the pages in place, the sinks in its softmax). Then: the sinks are read from the folder and
change the logits, the SwiGLU clamp changes them too, and the router and experts alone equal GptOssMLP.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.tiny_models import GPT_OSS, GPT_OSS_WINDOW, VOCAB_SIZE, make_tiny_hf_model
from tests.worker.model.test_model_parity import PlanBuilder, run_scenario
from tests.worker.model.test_moe_parity import MAX_ABS_ERR, max_abs_diff
from worker.loader import load_model
from worker.model.attention import build_attention_metadata
from worker.model.kv_cache import allocate_kv_cache
from worker.model.moe import SparseMoE
from worker.model_runner import ModelRunner
from worker.native_ops import cpu_ops_available
from worker.options import WorkerOptions
from worker.step_batch import RequestSpan


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    folder, hf_model = make_tiny_hf_model(tmp_path_factory.mktemp("gpt_oss"), GPT_OSS)
    model, config = load_model(folder, progress=False)
    return folder, hf_model, model, config


def _logits(model, ids: list[int]) -> torch.Tensor:
    """One plain prefill of the loaded model over one sequence (one page holding it all): [S, V]."""
    cache = allocate_kv_cache(model.config, 4, 64, torch.float32, "cpu")
    metadata = build_attention_metadata([RequestSpan(0, len(ids), len(ids), [1])], 64)
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), cache, metadata))


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0]


IDS = torch.randint(0, VOCAB_SIZE, (40,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.parametrize("block_size, fused", [(4, False), (16, False), (4, True), (16, True)])
def test_paged_steps_match_transformers_past_the_window(gpt_oss, block_size, fused):
    _, hf_model, model, config = gpt_oss
    assert config.layer_windows == (GPT_OSS_WINDOW, None, GPT_OSS_WINDOW, None) and config.attention_sinks
    assert all(isinstance(layer.mlp, SparseMoE) for layer in model.layers)
    builder, rows = run_scenario(model, config, block_size=block_size, fused=fused)
    worst = max_abs_diff(builder, rows, hf_model)  # also: the greedy tokens are transformers' argmax
    print(f"gpt_oss block_size={block_size} fused={fused}: max |logit diff| vs transformers {worst:.3e}")
    assert worst <= MAX_ABS_ERR


@pytest.mark.parametrize("fused", [False, True])
def test_a_prompt_shorter_than_the_window_then_decode_past_it(gpt_oss, fused):
    """5 prompt tokens, then 9 decode steps: the sliding layers' window (8) fills and then slides."""
    _, hf_model, model, config = gpt_oss
    if fused and not cpu_ops_available():
        pytest.skip("compiled CPU ops not built (scripts/build_cpu_ops.py)")
    runner = ModelRunner(model, config, num_blocks=16, block_size=4, dtype=torch.float32,
                         options=WorkerOptions(cpu_fused_ops=fused))
    assert runner.execution_path.fused_ops == fused
    builder = PlanBuilder(runner.num_blocks, 4, seed=3)
    builder.add("S", IDS[:5])
    plan = builder.plan({"S": 5}, {"S"})
    builder.record(plan, runner.execute(plan).sampled_token_ids)
    for _ in range(9):
        plan = builder.plan({"S": 1})
        builder.record(plan, runner.execute(plan).sampled_token_ids)
    tokens = builder.tokens["S"]
    assert len(tokens) == 15
    expected = _hf_logits(hf_model, tokens)
    assert tokens[5:] == expected[4:-1].argmax(-1).tolist()  # every decode step took transformers' argmax
    short = _logits(model, tokens[:5])  # the prompt alone, inside the window
    assert (short - expected[:5]).abs().max().item() <= MAX_ABS_ERR


def _with_tensors(folder, tmp_path, change) -> tuple:
    """A copy of the folder whose tensors change(tensors) edited in place."""
    copy = shutil.copytree(folder, tmp_path / "changed")
    tensors = load_file(str(copy / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(copy / "model.safetensors"))
    return copy


def test_the_sinks_are_read_from_the_folder_and_change_the_logits(gpt_oss, tmp_path):
    folder, hf_model, model, _ = gpt_oss
    for i, layer in enumerate(model.layers):
        assert torch.equal(layer.attn.sinks, hf_model.model.layers[i].self_attn.sinks)

    def zero_sinks(tensors):
        for name in [name for name in tensors if name.endswith(".self_attn.sinks")]:
            tensors[name] = torch.zeros_like(tensors[name])

    unsunk, _ = load_model(_with_tensors(folder, tmp_path, zero_sinks), progress=False)
    ours, changed = _logits(model, IDS), _logits(unsunk, IDS)
    assert (ours - changed).abs().max().item() > 0.05  # the sinks take a real share of every softmax
    with torch.no_grad():  # and the changed model is still transformers' with the same change
        for layer in hf_model.model.layers:
            layer.self_attn.sinks.zero_()
        try:
            expected = _hf_logits(hf_model, IDS)
        finally:
            for i, layer in enumerate(hf_model.model.layers):
                layer.self_attn.sinks.copy_(model.layers[i].attn.sinks)
    assert (changed - expected).abs().max().item() <= MAX_ABS_ERR


def test_the_swiglu_clamp_changes_the_logits(gpt_oss):
    """The test model's limit (1.5) is inside its gate/up range, so dropping the clamp moves the logits."""
    _, _, model, config = gpt_oss
    assert config.swiglu_limit == 1.5 and config.swiglu_alpha == 1.702
    clamped = _logits(model, IDS)
    experts = [layer.mlp.experts for layer in model.layers]
    try:
        for module in experts:
            module.swiglu = (1e9, config.swiglu_alpha)
        unclamped = _logits(model, IDS)
    finally:
        for module in experts:
            module.swiglu = (config.swiglu_limit, config.swiglu_alpha)
    assert (clamped - unclamped).abs().max().item() > 0.01


def test_router_and_experts_equal_gpt_oss_mlp(gpt_oss):
    """A layer's SparseMoE (the de-interleaved gate/up, the biases, top-k over the logits then the softmax) against
    transformers' GptOssMLP over the same inputs, spread wide enough that the clamps and every expert are hit."""
    _, hf_model, model, _ = gpt_oss
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(2)) * 3
    with torch.no_grad():
        for ours, theirs in zip(model.layers, hf_model.model.layers):
            expected, _ = theirs.mlp(x[None])
            _, top_experts = torch.topk(torch.nn.functional.linear(x, ours.mlp.router_weight, ours.mlp.router_bias), 2)
            assert top_experts.unique().numel() == model.config.num_experts
            assert (ours.mlp(x) - expected[0]).abs().max().item() <= 1e-5
