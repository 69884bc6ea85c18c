"""Hugging Face tensor names and shapes, and turning an HF-named state dict into a fused LlamaModel.

Both loaders (GGUF and HF folder) produce HF-named tensors, checked against expected_hf_shapes();
build_model() then fuses q/k/v and gate/up (one matmul each instead of three / two).
"""
from __future__ import annotations

import torch

from worker.linears.ggml_blocks import GGMLBlocksEmbedding, GGMLBlocksLinear, GGMLBlocksWeight
from worker.linears.ggml_experts import ExpertBlocksWeight, GGMLBlocksExperts
from worker.linears.group_quant import GroupQuantEmbedding, GroupQuantLinear, GroupQuantWeight
from worker.loader.gguf_quants import SUPPORTED_TYPES, group_quant_from_blocks
from worker.loader.errors import ModelLoadError
from worker.model.config import ModelConfig
from worker.model.llama import LlamaModel

LM_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"
# HF names of the weights that feed a matmul: the ones a file may hand over still quantized
LINEAR_WEIGHTS = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "qkv", "gate", "up", "down", "gate_up")) + (LM_HEAD,)
GEMMA_NORM_ARCHITECTURES = ("gemma2", "gemma3")  # RMSNorm scales by (1 + w): folded into w at load
# a mixture-of-experts layer's tensors, as transformers 5 holds them in memory (the loaders stack older per-expert
# names and GGUF's ffn_*_exps into these): router [E, H], experts' gate rows then up rows [E, 2I, H], down [E, H, I]
ROUTER, EXPERTS_GATE_UP, EXPERTS_DOWN = "mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
# gpt-oss (GptOssMLP) names its router `mlp.router` (with a bias) and holds its experts for x @ W: gate_up [E, H, 2I]
# with gate and up interleaved along the columns (gate at 0, 2, 4, ...), down [E, I, H], each with a bias;
# _gpt_oss_experts turns them into the stacked layout above
GPT_OSS_ROUTER, GPT_OSS_ROUTER_BIAS = "mlp.router.weight", "mlp.router.bias"
EXPERTS_GATE_UP_BIAS, EXPERTS_DOWN_BIAS = "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"


def fused_projections(config: ModelConfig) -> bool:
    """phi3 checkpoints hold qkv_proj and gate_up_proj already fused."""
    return config.architecture == "phi3"


def gpt_oss_layout(config: ModelConfig) -> bool:
    """gpt-oss checkpoints hold the router and the experts under their own names and layout (GPT_OSS_ROUTER, ...)."""
    return config.architecture == "gpt_oss"


def expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by HF name (lm_head only when untied)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}"
        shapes[f"{prefix}.input_layernorm.weight"] = (hidden,)
        if fused_projections(config):
            shapes[f"{prefix}.self_attn.qkv_proj.weight"] = (config.q_size + 2 * config.kv_size, hidden)
        else:
            shapes[f"{prefix}.self_attn.q_proj.weight"] = (config.q_size, hidden)
            shapes[f"{prefix}.self_attn.k_proj.weight"] = (config.kv_size, hidden)
            shapes[f"{prefix}.self_attn.v_proj.weight"] = (config.kv_size, hidden)
        if config.attention_bias:
            shapes[f"{prefix}.self_attn.q_proj.bias"] = (config.q_size,)
            shapes[f"{prefix}.self_attn.k_proj.bias"] = (config.kv_size,)
            shapes[f"{prefix}.self_attn.v_proj.bias"] = (config.kv_size,)
        if config.qk_norm:  # olmoe: over the whole projection
            shapes[f"{prefix}.self_attn.q_norm.weight"] = (config.q_size if config.qk_norm_whole else config.head_dim,)
            shapes[f"{prefix}.self_attn.k_norm.weight"] = (config.kv_size if config.qk_norm_whole else config.head_dim,)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (hidden, config.q_size)
        if config.attention_out_bias:
            shapes[f"{prefix}.self_attn.o_proj.bias"] = (hidden,)
        if config.attention_sinks:
            shapes[f"{prefix}.self_attn.sinks"] = (config.num_heads,)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        if config.sandwich_norms:
            shapes[f"{prefix}.pre_feedforward_layernorm.weight"] = (hidden,)
            shapes[f"{prefix}.post_feedforward_layernorm.weight"] = (hidden,)
        shapes.update(_mlp_shapes(config, i, prefix))
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes[LM_HEAD] = (config.vocab_size, hidden)
    return shapes


def _mlp_shapes(config: ModelConfig, layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    if config.is_moe_layer(layer):
        experts, expert_inter = config.num_experts, config.moe_intermediate_size
        if gpt_oss_layout(config):
            return {f"{prefix}.{GPT_OSS_ROUTER}": (experts, hidden), f"{prefix}.{GPT_OSS_ROUTER_BIAS}": (experts,),
                    f"{prefix}.{EXPERTS_GATE_UP}": (experts, hidden, 2 * expert_inter),
                    f"{prefix}.{EXPERTS_GATE_UP_BIAS}": (experts, 2 * expert_inter),
                    f"{prefix}.{EXPERTS_DOWN}": (experts, expert_inter, hidden),
                    f"{prefix}.{EXPERTS_DOWN_BIAS}": (experts, hidden)}
        return {f"{prefix}.{ROUTER}": (experts, hidden), f"{prefix}.{EXPERTS_GATE_UP}": (experts, 2 * expert_inter, hidden),
                f"{prefix}.{EXPERTS_DOWN}": (experts, hidden, expert_inter)}
    if fused_projections(config):
        shapes = {f"{prefix}.mlp.gate_up_proj.weight": (2 * inter, hidden)}
    else:
        shapes = {f"{prefix}.mlp.gate_proj.weight": (inter, hidden), f"{prefix}.mlp.up_proj.weight": (inter, hidden)}
    return {**shapes, f"{prefix}.mlp.down_proj.weight": (hidden, inter)}


def check_shape(source: str, tensor_name: str, actual: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(actual) != tuple(expected):
        raise ModelLoadError(
            f"{source}: tensor {tensor_name!r} has shape {tuple(actual)}, expected {tuple(expected)} from the model config"
        )


def cat_rows(parts: list) -> torch.Tensor | GroupQuantWeight | GGMLBlocksWeight:
    """Fused projections: quantized parts stay quantized (block parts each in its own type; else one
    group_quant layout for all, a block part converted to it exactly); a part the file held as floats, or
    a block part beside converted ones in a type group_quant has no layout for (IQ4_NL q/k beside a Q5_1 v,
    as llama.cpp writes rows that are not a multiple of 256), makes the whole fusion float (the quantized
    parts dequantized, exactly; float32 where no part gives a dtype: the model's build casts it)."""
    if all(isinstance(p, GGMLBlocksWeight) for p in parts):
        return GGMLBlocksWeight.concat_rows(parts)
    if all(isinstance(p, GroupQuantWeight) or (isinstance(p, GGMLBlocksWeight) and _convertible(p)) for p in parts):
        return GroupQuantWeight.concat_rows([_group_quant(p) for p in parts])
    dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), torch.float32)
    return torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize().to(dtype) for p in parts])


def _convertible(weight: GGMLBlocksWeight) -> bool:
    return all(part.type_name in SUPPORTED_TYPES for part in weight.parts)


def _group_quant(weight: GroupQuantWeight | GGMLBlocksWeight) -> GroupQuantWeight:
    if isinstance(weight, GroupQuantWeight):
        return weight
    return GroupQuantWeight.concat_rows([group_quant_from_blocks(part.type_name, part.blocks.numpy(), part.rows,
                                                                 weight.in_features) for part in weight.parts])


def fuse_hf_state_dict(config: ModelConfig, hf: dict, norm_offset: float = 0.0) -> dict:
    """HF names -> LlamaModel names, with q/k/v and gate/up concatenated along the output rows.
    norm_offset is added to every norm weight (1.0 for gemma's (1 + w) norms as HF stores them).
    Linear weights may be GroupQuantWeight (a GGUF file's quantized tensors); they stay so."""

    def norm(name: str) -> torch.Tensor:
        return hf[name] if not norm_offset else (hf[name].float() + norm_offset).to(hf[name].dtype)

    fused = {"embed_tokens.weight": hf["model.embed_tokens.weight"], "norm.weight": norm("model.norm.weight")}
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}", f"layers.{i}"
        attn = f"{src}.self_attn"
        fused[f"{dst}.attn_norm.weight"] = norm(f"{src}.input_layernorm.weight")
        if fused_projections(config):
            fused[f"{dst}.attn.wqkv.weight"] = hf[f"{attn}.qkv_proj.weight"]
        else:
            fused[f"{dst}.attn.wqkv.weight"] = cat_rows([hf[f"{attn}.{p}_proj.weight"] for p in "qkv"])
        fused.update(_fused_mlp(config, hf, i, src, dst))
        if config.attention_bias:
            fused[f"{dst}.attn.wqkv.bias"] = torch.cat([hf[f"{attn}.{p}_proj.bias"] for p in "qkv"])
        if config.qk_norm:
            fused[f"{dst}.attn.q_norm.weight"] = norm(f"{attn}.q_norm.weight")
            fused[f"{dst}.attn.k_norm.weight"] = norm(f"{attn}.k_norm.weight")
        fused[f"{dst}.attn.wo.weight"] = hf[f"{attn}.o_proj.weight"]
        if config.attention_out_bias:
            fused[f"{dst}.attn.wo.bias"] = hf[f"{attn}.o_proj.bias"]
        if config.attention_sinks:
            fused[f"{dst}.attn.sinks"] = hf[f"{attn}.sinks"]
        if config.sandwich_norms:  # gemma: post_attention_layernorm norms the attention output
            fused[f"{dst}.post_attn_norm.weight"] = norm(f"{src}.post_attention_layernorm.weight")
            fused[f"{dst}.mlp_norm.weight"] = norm(f"{src}.pre_feedforward_layernorm.weight")
            fused[f"{dst}.post_mlp_norm.weight"] = norm(f"{src}.post_feedforward_layernorm.weight")
        else:
            fused[f"{dst}.mlp_norm.weight"] = norm(f"{src}.post_attention_layernorm.weight")
    # a tied model's file may still give lm_head its own quantized copy of the embedding (read_gguf)
    fused["lm_head.weight"] = hf[LM_HEAD] if LM_HEAD in hf else fused["embed_tokens.weight"]
    return fused


def _gpt_oss_experts(hf: dict, src: str, dst: str) -> dict:
    """gpt-oss's router and experts -> SparseMoE's parameters: gate_up [E, H, 2I] (x @ W, gate and up interleaved)
    becomes [E, 2I, H] with the gate rows first, its bias [E, 2I] likewise; down [E, I, H] becomes [E, H, I]."""
    gate_up = hf[f"{src}.{EXPERTS_GATE_UP}"].transpose(1, 2)  # [E, 2I, H], rows gate, up, gate, up, ...
    gate_up_bias = hf[f"{src}.{EXPERTS_GATE_UP_BIAS}"]  # [E, 2I], the same interleaving
    return {f"{dst}.mlp.router_weight": hf[f"{src}.{GPT_OSS_ROUTER}"],
            f"{dst}.mlp.router_bias": hf[f"{src}.{GPT_OSS_ROUTER_BIAS}"],
            f"{dst}.mlp.experts.gate_up": torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1),
            f"{dst}.mlp.experts.gate_up_bias": torch.cat((gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]), dim=1),
            f"{dst}.mlp.experts.down": hf[f"{src}.{EXPERTS_DOWN}"].transpose(1, 2),
            f"{dst}.mlp.experts.down_bias": hf[f"{src}.{EXPERTS_DOWN_BIAS}"]}


def _fused_mlp(config: ModelConfig, hf: dict, layer: int, src: str, dst: str) -> dict:
    if config.is_moe_layer(layer) and gpt_oss_layout(config):
        return _gpt_oss_experts(hf, src, dst)
    if config.is_moe_layer(layer):  # worker.model.moe.SparseMoE's stacked parameters
        return {f"{dst}.mlp.router_weight": hf[f"{src}.{ROUTER}"], f"{dst}.mlp.experts.gate_up": hf[f"{src}.{EXPERTS_GATE_UP}"],
                f"{dst}.mlp.experts.down": hf[f"{src}.{EXPERTS_DOWN}"]}
    if fused_projections(config):
        gate_up = hf[f"{src}.mlp.gate_up_proj.weight"]  # gate rows, then up
    else:
        gate_up = cat_rows([hf[f"{src}.mlp.gate_proj.weight"], hf[f"{src}.mlp.up_proj.weight"]])
    return {f"{dst}.mlp.w_gate_up.weight": gate_up, f"{dst}.mlp.w_down.weight": hf[f"{src}.mlp.down_proj.weight"]}


def build_model(config: ModelConfig, hf: dict[str, torch.Tensor], dtype: torch.dtype, norms_hold_offset: bool = False) -> LlamaModel:
    """hf: checked HF-named tensors (already in dtype). Builds on the meta device so no random init runs.
    norms_hold_offset: gemma norm weights already hold the 1 (llama.cpp's converter adds it)."""
    gemma_norms = config.architecture in GEMMA_NORM_ARCHITECTURES and not norms_hold_offset
    fused = fuse_hf_state_dict(config, hf, norm_offset=1.0 if gemma_norms else 0.0)
    quantized = {name: t for name, t in fused.items() if isinstance(t, (GroupQuantWeight, GGMLBlocksWeight))}
    expert_blocks = {name: t for name, t in fused.items() if isinstance(t, ExpertBlocksWeight)}
    with torch.device("meta"):
        model = LlamaModel(config)
    result = model.load_state_dict({name: t.to(dtype).contiguous() for name, t in fused.items()
                                    if name not in quantized and name not in expert_blocks}, strict=False, assign=True)
    if result.unexpected_keys or set(result.missing_keys) != set(quantized) | set(expert_blocks):
        missing = set(result.missing_keys) - set(quantized) - set(expert_blocks)
        raise ModelLoadError(f"state dict does not match the model: missing {sorted(missing)}, "
                             f"unexpected {sorted(result.unexpected_keys)}")
    for name, gate_up in expert_blocks.items():  # a GGUF MoE layer's experts kept in the file's blocks
        if name.endswith(".experts.gate_up"):
            moe = model.get_submodule(name.removesuffix(".experts.gate_up"))
            down = expert_blocks[name.removesuffix("gate_up") + "down"]
            moe.experts = GGMLBlocksExperts(gate_up, down, config.hidden_act)
    if config.tie_word_embeddings and LM_HEAD not in quantized:
        model.lm_head.weight = model.embed_tokens.weight  # assign=True gave each name its own Parameter
    for name, weight in quantized.items():
        module_path = name.removesuffix(".weight")
        parent_path, _, child = module_path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        blocks = isinstance(weight, GGMLBlocksWeight)
        if module_path == "embed_tokens":
            setattr(parent, child, (GGMLBlocksEmbedding if blocks else GroupQuantEmbedding)(weight, dtype))
            continue
        bias = getattr(parent, child).bias
        bias = None if bias is None else bias.detach().float()
        setattr(parent, child, GGMLBlocksLinear(weight, bias) if blocks else GroupQuantLinear(weight, bias))
    return model.eval().requires_grad_(False)
