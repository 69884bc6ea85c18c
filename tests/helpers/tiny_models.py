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

FLAVOURS = ("llama", "llama_gqa", "mistral", "qwen2")
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


def _config(flavour: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    if flavour == "llama":  # GQA ratio 1, tied embeddings like SmolLM2
        return LlamaConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=4, rope_theta=500.0, tie_word_embeddings=True)
    if flavour == "llama_gqa":  # ratio 3; heads * head_dim (96) != hidden (48) on purpose
        config = dict(_COMMON, hidden_size=48)
        return LlamaConfig(**config, num_attention_heads=6, num_key_value_heads=2, rope_theta=2000.0, tie_word_embeddings=False)
    if flavour == "mistral":
        return MistralConfig(**_COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=3000.0, sliding_window=None, tie_word_embeddings=False)
    if flavour == "qwen2":  # q/k/v bias, untied
        return Qwen2Config(**_COMMON, num_attention_heads=4, num_key_value_heads=2, rope_theta=7000.0, tie_word_embeddings=False)
    raise ValueError(f"flavour {flavour!r} is not one of {FLAVOURS}")


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


def make_tiny_hf_model(tmp_path: Path, flavour: str = "llama", seed: int = 0):
    """Writes a tiny model folder under tmp_path; returns (folder, transformers model in eval, float32)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(flavour), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.3)
    folder = Path(tmp_path) / f"tiny-{flavour}"
    model.save_pretrained(folder, safe_serialization=True)
    write_tiny_tokenizer(folder)
    return folder, model.eval()
