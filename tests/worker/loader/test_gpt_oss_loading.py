"""gpt-oss from Hugging Face folders: openai's config.json read as transformers reads it, what is refused at load
and at start (MXFP4 experts, a missing sinks tensor, a tensor-parallel split) and where auto runs it. Its logits:
tests/worker/model/test_gpt_oss_parity.py, tests/worker/paths/test_moe_paths.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_models import GPT_OSS, copy_without_tensor, make_tiny_hf_model
from worker.loader import ModelLoadError, load_model
from worker.loader.hf_loader import parse_hf_config
from worker.options import WorkerOptions
from worker.parallel.shard import check_split
from worker.paths.base import resolve_execution

# openai/gpt-oss-20b's config.json as released (transformers 4.55's keys), less its quantization_config
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
}


def _parse(raw: dict):
    return parse_hf_config(raw, Path("config.json"), tie_word_embeddings=False)


def test_openai_gpt_oss_20b_config_parses():
    config = _parse(GPT_OSS_20B)
    assert config.architecture == "gpt_oss"
    assert config.layer_windows == (128, None) * 12  # sliding / full alternating, as layer_types says
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (32, 4, 2880)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.rope_theta) == (64, 8, 64, 150000.0)
    assert config.attention_sinks and config.attention_bias and config.attention_out_bias
    assert config.router_bias and config.router_topk_first and config.expert_bias
    assert (config.swiglu_limit, config.swiglu_alpha) == (7.0, 1.702)
    scaling = config.rope_scaling
    assert (scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings, scaling.truncate) == (
        "yarn", 32.0, 4096, False)


def test_mxfp4_experts_are_refused_naming_why():
    raw = GPT_OSS_20B | {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}}
    with pytest.raises(ModelLoadError, match="quantization_config quant_method='mxfp4' is not supported: tokenmill "
                                             "reads gpt-oss experts as float tensors .* not MXFP4 blocks"):
        _parse(raw)


@pytest.fixture(scope="module")
def tiny_gpt_oss(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("gpt_oss"), GPT_OSS)


def test_a_missing_sinks_tensor_is_named(tiny_gpt_oss, tmp_path):
    folder, _ = tiny_gpt_oss
    broken = copy_without_tensor(folder, tmp_path / "broken", "model.layers.3.self_attn.sinks")
    with pytest.raises(ModelLoadError, match="'model.layers.3.self_attn.sinks' is missing"):
        load_model(broken, progress=False)


def test_auto_takes_triton_with_graphs_on_cuda_and_torch_on_the_cpu(tiny_gpt_oss):
    _, config = load_model(tiny_gpt_oss[0], progress=False)
    cuda = resolve_execution(WorkerOptions(), torch.device("cuda", 0), config)  # resolving touches no device
    assert (cuda.kernel_backend, cuda.cuda_graphs) == ("triton", True)
    assert resolve_execution(WorkerOptions(), "cpu", config).kernel_backend == "torch"
    assert resolve_execution(WorkerOptions(kernel_backend="triton"), "cpu", config).kernel_backend == "triton"


def test_a_tensor_parallel_split_is_refused(tiny_gpt_oss):
    _, config = load_model(tiny_gpt_oss[0], progress=False)
    check_split(config, 1)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2: gpt_oss's attention sinks .* have no split yet"):
        check_split(config, 2)
