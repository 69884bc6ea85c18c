"""Tiny random-weight Hugging Face model folders (no model hub here), one per supported flavour.

Each folder holds what a real one does: config.json, model.safetensors, tokenizer.json (byte-level
BPE over the 256 byte symbols plus <s> and </s>) and tokenizer_config.json. Weights are drawn with a
larger spread than HF's default init, and norms/biases are randomised too, so that a loader that
drops a bias, swaps two norms or gets RoPE wrong changes the logits well beyond the test tolerance.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

FLAVOURS = (
    "llama", "llama_gqa", "llama3_rope", "llama_linear_rope", "llama_dynamic_rope", "llama_yarn_rope",
    "mistral", "mistral_window", "qwen2", "qwen2_tied", "qwen3", "gemma2", "gemma3", "phi3",
)
# mixtures of experts (tests/worker/model/test_moe_parity.py): 8 experts, top 2
MOE_FLAVOURS = ("qwen3_moe", "mixtral", "olmoe")
NUM_EXPERTS, TOP_K = 8, 2
# gpt-oss (tests/worker/model/test_gpt_oss_parity.py): attention sinks, sliding / full layers alternating, 4
# experts top 2 with biases and the clamped SwiGLU, YaRN; its own window of 8 so prompts run past it
GPT_OSS = "gpt_oss"
GPT_OSS_WINDOW = 8
# the windows are far shorter than the test prompts (25-50 tokens), so attending outside them shows
SLIDING_WINDOW = 7
BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
VOCAB_SIZE = 258  # 256 byte symbols + <s> (256) + </s> (257)
BOS_ID, EOS_ID = 256, 257

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    initializer_range=0.1,
)


def tiny_hf_config(flavour: str):
    """The transformers config of one flavour (the tiny model's sizes and the family's switches)."""
    from transformers import (Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config,
                              Qwen3Config)

    llama_rope = {  # original lengths below the test lengths where the type depends on it
        "llama3_rope": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64),
        "llama_linear_rope": dict(rope_type="linear", factor=4.0),
        "llama_dynamic_rope": dict(rope_type="dynamic", factor=2.0),
        "llama_yarn_rope": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128),
    }
    if flavour in llama_rope:
        rope = dict(llama_rope[flavour], rope_theta=10000.0)
        return LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope, tie_word_embeddings=False)
    if flavour == "mistral_window":
        return MistralConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=3000.0, sliding_window=SLIDING_WINDOW, tie_word_embeddings=False)
    if flavour == "qwen2_tied":
        return Qwen2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=7000.0, tie_word_embeddings=True)
    if flavour == "qwen3":  # per-head q/k RMSNorm, no bias; heads * head_dim (128) != hidden (64)
        return Qwen3Config(**dict(_COMMON, head_dim=32), num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0, tie_word_embeddings=False)
    gemma = dict(_COMMON, hidden_size=48, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24, pad_token_id=0,
                 sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"])
    if flavour == "gemma2":  # soft-caps small enough to bite with these weights
        return Gemma2Config(**gemma, num_attention_heads=4, num_key_value_heads=2, attn_logit_softcapping=5.0,
                            final_logit_softcapping=3.0, tie_word_embeddings=True)
    if flavour == "gemma3":  # q/k norms; global layers linear-scaled rope, local ones their own base
        rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}
        return Gemma3TextConfig(**gemma, num_attention_heads=4, num_key_value_heads=1, rope_parameters=rope, tie_word_embeddings=True)
    if flavour == "phi3":  # fused qkv / gate_up, longrope (short factors and the attention factor of 512 / 256 at test lengths)
        rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.1 * i for i in range(8)],
                    long_factor=[1.0 + 0.5 * i for i in range(8)], original_max_position_embeddings=256)
        return Phi3Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, rope_parameters=rope,
                          original_max_position_embeddings=256, pad_token_id=0, sliding_window=None, tie_word_embeddings=False)
    if flavour == "llama":  # GQA ratio 1, tied embeddings like SmolLM2
        return LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=4, rope_theta=500.0, tie_word_embeddings=True)
    if flavour == "llama_gqa":  # ratio 3; heads * head_dim (96) != hidden (48) on purpose
        config = dict(_COMMON, hidden_size=48)
        return LlamaConfig(**config, num_attention_heads=6, num_key_value_heads=2, rope_theta=2000.0, tie_word_embeddings=False)
    if flavour == "mistral":
        return MistralConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=3000.0, sliding_window=None, tie_word_embeddings=False)
    if flavour == "qwen2":  # q/k/v bias, untied
        return Qwen2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=7000.0, tie_word_embeddings=False)
    if flavour in MOE_FLAVOURS:
        return _tiny_moe_config(flavour)
    if flavour == GPT_OSS:
        return _tiny_gpt_oss_config()
    raise ValueError(f"flavour {flavour!r} is not one of {FLAVOURS + MOE_FLAVOURS + (GPT_OSS,)}")


def _tiny_moe_config(flavour: str):
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    heads = dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    if flavour == "qwen3_moe":  # renormalised top-k; layer 1 a dense MLP (mlp_only_layers); head_dim * heads != hidden
        return Qwen3MoeConfig(**dict(_COMMON, head_dim=32, num_hidden_layers=3), **heads, rope_theta=5000.0,
                              num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=32,
                              norm_topk_prob=True, mlp_only_layers=[1])
    if flavour == "mixtral":  # softmax over the top-k logits (= the renormalised top-k), weights kept in float32
        return MixtralConfig(**dict(_COMMON, intermediate_size=48), **heads, rope_theta=3000.0,
                             num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, sliding_window=None)
    # olmoe: q/k norms over the whole projections, top-k weights not renormalised
    return OlmoeConfig(**dict(_COMMON, intermediate_size=40), **heads, rope_theta=7000.0, num_experts=NUM_EXPERTS,
                       num_experts_per_tok=TOP_K, norm_topk_prob=False)


def _tiny_gpt_oss_config():
    """4 layers (sliding, full, sliding, full), 4 heads on 2 KV heads, 4 experts top 2; YaRN with an original
    length of 32 (not truncated, as openai's config), and a SwiGLU limit low enough that the clamps bite."""
    from transformers import GptOssConfig

    rope = dict(rope_type="yarn", rope_theta=150000.0, factor=16.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                original_max_position_embeddings=32)
    return GptOssConfig(**dict(_COMMON, intermediate_size=32, num_hidden_layers=4), num_attention_heads=4,
                        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=TOP_K,
                        sliding_window=GPT_OSS_WINDOW, rope_parameters=rope, swiglu_limit=1.5,
                        tie_word_embeddings=False)


def write_tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 printable stand-ins for the bytes
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    vocab[BOS_TOKEN], vocab[EOS_TOKEN] = BOS_ID, EOS_ID
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([BOS_TOKEN, EOS_TOKEN])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "model_max_length": 512, "tokenizer_class": "PreTrainedTokenizerFast"})
    )


def make_tiny_hf_model(tmp_path: Path, flavour: str = "llama", seed: int = 0, **overrides):
    """Writes a tiny model folder under tmp_path; returns (folder, transformers model in eval, float32).
    overrides: config attributes set after the flavour's (e.g. what a GGUF file cannot express)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_hf_config(flavour)
    for name, value in overrides.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith((".bias", "_bias")):  # gpt-oss's experts: gate_up_proj_bias, down_proj_bias
                param.normal_(0.0, 0.3)
            elif name.endswith(".sinks"):  # gpt-oss: around the scores' own size, so they take a real share
                param.normal_(0.0, 1.0)
    folder = Path(tmp_path) / f"tiny-{flavour}"
    model.save_pretrained(folder, safe_serialization=True)
    write_tiny_tokenizer(folder)
    return folder, model.eval()


def copy_without_tensor(folder: Path, dest: Path, name: str) -> Path:
    """A copy of a tiny model's folder at dest whose model.safetensors lacks the tensor name (a loader's
    missing-tensor error)."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = Path(shutil.copytree(folder, dest))
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(broken / "model.safetensors"))
    return broken
