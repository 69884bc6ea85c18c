"""Hugging Face tensor names and shapes, and turning an HF-named state dict into a fused LlamaModel.

Both loaders (GGUF and HF folder) produce HF-named tensors, checked against expected_hf_shapes();
build_model() then fuses q/k/v and gate/up (one matmul each instead of three / two).
"""
from __future__ import annotations

import torch

from worker.config import ModelConfig
from worker.loader.errors import ModelLoadError
from worker.model import LlamaModel

LM_HEAD = "lm_head.weight"


def expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by HF name (lm_head only when untied)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (config.q_size, hidden)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (config.kv_size, hidden)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (config.kv_size, hidden)
        if config.attention_bias:
            shapes[f"{prefix}.self_attn.q_proj.bias"] = (config.q_size,)
            shapes[f"{prefix}.self_attn.k_proj.bias"] = (config.kv_size,)
            shapes[f"{prefix}.self_attn.v_proj.bias"] = (config.kv_size,)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, config.q_size)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (config.vocab_size, hidden)
    return shapes


def check_shape(source: str, tensor_name: str, actual: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(actual) != tuple(expected):
        raise ModelLoadError(
            f"{source}: tensor {tensor_name!r} has shape {tuple(actual)}, expected {tuple(expected)} from the model config"
        )


def fuse_hf_state_dict(config: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> LlamaModel names, with q/k/v and gate/up concatenated along the output rows."""
    fused = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        attn = f"{src}.self_attn"
        fused[f"{dst}.attn_norm.weight"] = hf[f"{src}.input_layernorm.weight"]
        fused[f"{dst}.attn.wqkv.weight"] = torch.cat([hf[f"{attn}.{p}_proj.weight"] for p in "qkv"])
        if config.attention_bias:
            fused[f"{dst}.attn.wqkv.bias"] = torch.cat([hf[f"{attn}.{p}_proj.bias"] for p in "qkv"])
        fused[f"{dst}.attn.wo.weight"] = hf[f"{attn}.o_proj.weight"]
        fused[f"{dst}.mlp_norm.weight"] = hf[f"{src}.post_attention_layernorm.weight"]
        fused[f"{dst}.mlp.w_gate_up.weight"] = torch.cat([hf[f"{src}.mlp.gate_proj.weight"], hf[f"{src}.mlp.up_proj.weight"]])
        fused[f"{dst}.mlp.w_down.weight"] = hf[f"{src}.mlp.down_proj.weight"]
    fused["lm_head.weight"] = fused["embed_tokens.weight"] if config.tie_word_embeddings else hf[LM_HEAD]
    return fused


def build_model(config: ModelConfig, hf: dict[str, torch.Tensor], dtype: torch.dtype) -> LlamaModel:
    """hf: checked HF-named tensors (already in dtype). Builds on the meta device so no random init runs."""
    fused = fuse_hf_state_dict(config, hf)
    with torch.device("meta"):
        model = LlamaModel(config)
    model.load_state_dict({name: t.to(dtype).contiguous() for name, t in fused.items()}, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # assign=True gave each name its own Parameter
    return model.eval().requires_grad_(False)
