"""Mixture-of-experts checkpoints from Hugging Face folders: both expert layouts (per-expert tensors, as
transformers writes them; transformers 5's stacked 3-D gate_up_proj / down_proj), Qwen3-MoE's dense layers from
config.json, and the clear load-time errors for what is not supported (never a model that runs wrong)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.tiny_models import copy_without_tensor, make_tiny_hf_model
from worker.loader import ModelLoadError, load_model
from worker.loader.hf_loader import parse_hf_config


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("moe"), "qwen3_moe")


def _logits(model, ids: list[int]) -> torch.Tensor:
    """A plain forward of the loaded model over one sequence (no paging: one block holding it all)."""
    from worker.model.attention import build_attention_metadata
    from worker.model.kv_cache import allocate_kv_cache
    from worker.step_batch import RequestSpan

    cache = allocate_kv_cache(model.config, 4, 64, model.norm.weight.dtype, "cpu")
    metadata = build_attention_metadata([RequestSpan(0, len(ids), len(ids), [1])], 64)
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), cache, metadata)
        return model.compute_logits(hidden)


def test_stacked_3d_experts_load_as_the_per_expert_ones(qwen3_moe, tmp_path):
    """The same weights saved in transformers 5's in-memory layout (mlp.experts.gate_up_proj [E, 2I, H])."""
    folder, hf_model = qwen3_moe
    stacked = shutil.copytree(folder, tmp_path / "stacked")
    (stacked / "model.safetensors").unlink()
    save_file({name: t.contiguous() for name, t in hf_model.state_dict().items()}, str(stacked / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(str(stacked / "model.safetensors"))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in load_file(str(folder / "model.safetensors"))
    per_expert, _ = load_model(folder, progress=False)
    fused, _ = load_model(stacked, progress=False)
    ids = list(range(3, 40))
    assert torch.equal(_logits(per_expert, ids), _logits(fused, ids))
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0]
    assert (_logits(fused, ids) - expected).abs().max().item() <= 1e-4


def test_a_missing_expert_is_named(qwen3_moe, tmp_path):
    folder, _ = qwen3_moe
    broken = copy_without_tensor(folder, tmp_path / "broken", "model.layers.2.mlp.experts.5.up_proj.weight")
    with pytest.raises(ModelLoadError, match="'model.layers.2.mlp.experts.5.up_proj.weight' is missing"):
        load_model(broken, progress=False)


def _parse(raw: dict):
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4)
    return parse_hf_config(base | raw, Path("config.json"), tie_word_embeddings=False)


def test_moe_configs_parse():
    qwen = _parse({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128, "num_experts_per_tok": 8,
                   "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 2,
                   "mlp_only_layers": [3], "sliding_window": 4096, "use_sliding_window": False})
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size, qwen.norm_topk_prob) == (128, 8, 768, True)
    assert qwen.dense_mlp_layers == (0, 2, 3, 4) and qwen.qk_norm and not qwen.qk_norm_whole
    assert qwen.layer_windows == ()  # transformers drops the window without use_sliding_window
    assert [qwen.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    windowed = _parse({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
                       "sliding_window": 4096, "use_sliding_window": True})
    assert windowed.layer_windows == (4096,) * 6  # Qwen3MoeAttention: every layer, no max_window_layers
    mixtral = _parse({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "num_experts_per_tok": 2,
                      "intermediate_size": 14336, "sliding_window": 4096})
    assert (mixtral.moe_intermediate_size, mixtral.norm_topk_prob, mixtral.router_weights_float) == (14336, True, True)
    assert mixtral.layer_windows == (4096,) * 6 and not mixtral.qk_norm
    olmoe = _parse({"architectures": ["OlmoeForCausalLM"], "num_experts": 64, "num_experts_per_tok": 8})
    assert olmoe.qk_norm and olmoe.qk_norm_whole and not olmoe.norm_topk_prob and olmoe.dense_mlp_layers == ()


@pytest.mark.parametrize("architecture, model_type, missing", [
    ("DeepseekV3ForCausalLM", "deepseek_v3", "multi-head latent attention"),
    ("DeepseekV2ForCausalLM", "deepseek_v2", "multi-head latent attention"),
    ("Qwen2MoeForCausalLM", "qwen2_moe", "shared expert"),
])
def test_unsupported_moe_variants_name_what_is_missing(architecture, model_type, missing):
    with pytest.raises(ModelLoadError, match=f"mixture-of-experts variant '{model_type}' is not supported: tokenmill "
                                             f"has no .*{missing}.*; supported MoE architectures: qwen3_moe, mixtral, olmoe, "
                                             f"gpt_oss"):
        _parse({"architectures": [architecture], "model_type": model_type})


def test_olmoe_clip_qkv_is_refused():
    with pytest.raises(ModelLoadError, match="olmoe clip_qkv=8.0 is not supported"):
        _parse({"architectures": ["OlmoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 8.0})


def test_top_k_beyond_the_experts_is_refused():
    with pytest.raises(ModelLoadError, match="num_experts_per_tok=9 must be in 1..num_experts=8"):
        _parse({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "num_experts_per_tok": 9})
