"""Hugging Face folder loading: config facts, sharded weights, progress output, and every error case
raising ModelLoadError that names the file (and the tensor / shapes where they apply)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.tiny_models import make_tiny_hf_model
from worker.loader import ModelLoadError, load_model


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {flavour: make_tiny_hf_model(root, flavour)[0] for flavour in ("llama", "qwen2")}


@pytest.fixture
def llama_copy(tiny_folders, tmp_path):
    return shutil.copytree(tiny_folders["llama"], tmp_path / "model")


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


def test_config_facts_come_from_the_folder(tiny_folders):
    _, llama = load_model(tiny_folders["llama"], progress=False)
    assert (llama.architecture, llama.rope_theta, llama.tie_word_embeddings, llama.attention_bias) == ("llama", 500.0, True, False)
    assert (llama.num_layers, llama.hidden_size, llama.head_dim, llama.eos_token_id) == (2, 64, 16, 257)
    model, qwen2 = load_model(tiny_folders["qwen2"], progress=False)
    assert (qwen2.architecture, qwen2.rope_theta, qwen2.tie_word_embeddings, qwen2.attention_bias) == ("qwen2", 7000.0, False, True)
    assert model.layers[0].attn.wqkv.bias.shape == (qwen2.q_size + 2 * qwen2.kv_size,)


def test_fused_weights_and_tied_head(tiny_folders):
    model, config = load_model(tiny_folders["llama"], progress=False)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[0].attn.wqkv.weight.shape == (config.q_size + 2 * config.kv_size, config.hidden_size)
    assert model.layers[0].mlp.w_gate_up.weight.shape == (2 * config.intermediate_size, config.hidden_size)


def test_dtype_is_applied(tiny_folders):
    model, _ = load_model(tiny_folders["llama"], dtype=torch.bfloat16, progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_sharded_folder_loads_the_same_weights(tmp_path):
    folder, hf_model = make_tiny_hf_model(tmp_path, "llama_gqa")
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    single, _ = load_model(folder, progress=False)
    multi, _ = load_model(sharded, progress=False)
    for (name, a), (_, b) in zip(single.state_dict().items(), multi.state_dict().items()):
        assert torch.equal(a, b), name


def test_progress_goes_to_stderr_and_can_be_disabled(tiny_folders, capsys):
    load_model(tiny_folders["llama"], progress=True)
    assert "loading" in capsys.readouterr().err
    load_model(tiny_folders["llama"], progress=False)
    assert capsys.readouterr().err == ""


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="nope.*no such file"):
        load_model(tmp_path / "nope", progress=False)


def test_folder_without_config(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=f"{llama_copy}.*no config.json"):
        load_model(llama_copy, progress=False)


def test_folder_without_safetensors(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=f"{llama_copy}.*no \\*.safetensors"):
        load_model(llama_copy, progress=False)


def test_bad_json(llama_copy):
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: malformed JSON"):
        load_model(llama_copy, progress=False)


def test_missing_config_key(llama_copy):
    edit_config(llama_copy, hidden_size=None)
    with pytest.raises(ModelLoadError, match="config.json: missing key 'hidden_size'"):
        load_model(llama_copy, progress=False)


def test_unsupported_architecture_is_named_with_the_supported_list(llama_copy):
    edit_config(llama_copy, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(ModelLoadError, match="'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        load_model(llama_copy, progress=False)


@pytest.mark.parametrize("architecture", ["PhimoeForCausalLM", "Gemma3ForConditionalGeneration", "T5ForConditionalGeneration"])
def test_other_moe_multimodal_and_encoder_decoder_are_refused_by_name(llama_copy, architecture):
    edit_config(llama_copy, architectures=[architecture])
    with pytest.raises(ModelLoadError, match=f"architecture '{architecture}' is not supported; supported: .*Qwen3ForCausalLM.*Phi3ForCausalLM"):
        load_model(llama_copy, progress=False)


def test_unsupported_rope_scaling(llama_copy):
    edit_config(llama_copy, rope_parameters={"rope_type": "mrope", "rope_theta": 500.0, "factor": 4.0})
    with pytest.raises(ModelLoadError, match="rope scaling type 'mrope' is not supported; supported: default, linear, dynamic, llama3, yarn, longrope"):
        load_model(llama_copy, progress=False)


def test_missing_tensor_is_named(llama_copy):
    weights = load_file(llama_copy / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, llama_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match="tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
        load_model(llama_copy, progress=False)


def test_shape_mismatch_names_tensor_and_both_shapes(llama_copy):
    edit_config(llama_copy, intermediate_size=96)
    with pytest.raises(ModelLoadError) as excinfo:
        load_model(llama_copy, progress=False)
    message = str(excinfo.value)
    assert "model.safetensors" in message and "'model.layers.0.mlp.gate_proj.weight'" in message
    assert "shape (128, 64), expected (96, 64)" in message


def test_corrupt_safetensors(llama_copy):
    (llama_copy / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors: not a readable safetensors file"):
        load_model(llama_copy, progress=False)


def test_neither_gguf_nor_folder(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="weights.bin: expected a .gguf file or a Hugging Face model folder"):
        load_model(path, progress=False)


CONFIG_PATH = Path("config.json")


def _parse(raw: dict):
    from worker.loader.hf_loader import parse_hf_config

    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4)
    return parse_hf_config(base | raw, CONFIG_PATH, tie_word_embeddings=False)


def test_transformers_4_configs_of_each_family_parse():
    """config.json as transformers 4.x wrote them (rope_scaling and rope_theta at the top level)."""
    llama31 = _parse({"architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0, "max_position_embeddings": 131072,
                      "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}})
    assert llama31.rope_theta == 500000.0 and llama31.rope_scaling.rope_type == "llama3"
    assert llama31.rope_scaling.original_max_position_embeddings == 8192 and llama31.layer_windows == ()
    phi3 = _parse({"architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                   "sliding_window": 262144, "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}})
    assert phi3.rope_scaling.rope_type == "longrope" and phi3.rope_scaling.factor == 32.0
    assert phi3.layer_windows == (262144,) * 6
    gemma2 = _parse({"architectures": ["Gemma2ForCausalLM"], "head_dim": 32, "sliding_window": 4096, "query_pre_attn_scalar": 144,
                     "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    assert gemma2.layer_windows == (4096, None) * 3 and gemma2.query_scale == 144**-0.5
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.hidden_act) == (50.0, 30.0, "gelu_tanh")
    assert gemma2.embedding_multiplier == 8.0 and gemma2.sandwich_norms and not gemma2.qk_norm
    gemma3 = _parse({"architectures": ["Gemma3ForCausalLM"], "head_dim": 32, "sliding_window": 512, "sliding_window_pattern": 6,
                     "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 32,
                     "hidden_activation": "gelu_pytorch_tanh", "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert gemma3.layer_windows == (512,) * 5 + (None,) and gemma3.local_rope_theta == 10000.0
    assert gemma3.rope_scaling.rope_type == "linear" and gemma3.rope_theta == 1000000.0 and gemma3.qk_norm
    qwen2 = _parse({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 4})
    assert qwen2.layer_windows == (None,) * 4 + (32, 32) and qwen2.attention_bias
    mistral = _parse({"architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert mistral.layer_windows == (4096,) * 6


def test_partial_rotary_and_unknown_activations_are_refused():
    with pytest.raises(ModelLoadError, match="partial_rotary_factor != 1 is not supported"):
        _parse({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75})
    with pytest.raises(ModelLoadError, match="hidden activation 'relu2' is not supported; supported: silu, gelu_pytorch_tanh"):
        _parse({"architectures": ["LlamaForCausalLM"], "hidden_act": "relu2"})
