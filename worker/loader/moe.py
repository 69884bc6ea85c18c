"""Mixture-of-experts facts from a Hugging Face config.json or GGUF metadata, and where a folder stores experts.

A folder may hold a layer's experts as transformers 5 holds them in memory (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]) or, as transformers 4 wrote them and 5 still writes them, one
tensor per expert and projection (`mlp.experts.N.gate_proj.weight`; Mixtral's `block_sparse_moe.experts.N.w1`
(gate), `w3` (up), `w2` (down) and `block_sparse_moe.gate`): stored_expert_parts names the parts to stack.

Variants that route or attend in ways the model does not have are refused by name (UNSUPPORTED_VARIANTS).
"""
from __future__ import annotations

from pathlib import Path

from worker.loader.errors import ModelLoadError
from worker.loader.weights import EXPERTS_DOWN, EXPERTS_GATE_UP, ROUTER

MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "olmoe", "gpt_oss")
# HF architectures / model types of mixtures of experts that are not supported, and what they would need
UNSUPPORTED_VARIANTS = {
    "deepseek_v2": "DeepSeek's multi-head latent attention (MLA: compressed, low-rank K/V with a decoupled rotary "
                   "part), its shared experts and grouped top-k routing",
    "deepseek_v3": "DeepSeek's multi-head latent attention (MLA: compressed, low-rank K/V with a decoupled rotary "
                   "part), its shared experts and its sigmoid router with a score-correction bias and group-limited top-k",
    "qwen2_moe": "Qwen2-MoE's shared expert with its sigmoid gate",
    "qwen3_next": "Qwen3-Next's gated delta-net (linear attention) layers and shared expert",
    "llama4": "Llama 4's shared expert, sigmoid router and chunked attention",
    "dbrx": "DBRX's fused expert layout and clipped q/k/v",
}
UNSUPPORTED_CLASSES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3",
                       "Qwen2MoeForCausalLM": "qwen2_moe",
                       "Qwen3NextForCausalLM": "qwen3_next", "Llama4ForCausalLM": "llama4",
                       "Llama4ForConditionalGeneration": "llama4", "DbrxForCausalLM": "dbrx"}


def refuse_unsupported_variant(raw: dict, config_path: Path) -> None:
    """Raises ModelLoadError naming what a known-unsupported MoE variant needs; returns for anything else."""
    names = [UNSUPPORTED_CLASSES.get(name) for name in raw.get("architectures") or []] + [raw.get("model_type")]
    variant = next((name for name in names if name in UNSUPPORTED_VARIANTS), None)
    if variant is not None:
        raise ModelLoadError(f"{config_path}: mixture-of-experts variant {variant!r} is not supported: tokenmill has no "
                             f"{UNSUPPORTED_VARIANTS[variant]}; supported MoE architectures: {', '.join(MOE_ARCHITECTURES)}")


def _gpt_oss_fields(raw: dict, config_path: Path) -> dict:
    """GptOssConfig's: its experts and router, and the attention switches only it has (sinks, the o_proj bias)."""
    quantization = raw.get("quantization_config") or {}
    if quantization:  # openai's released folders: the experts as MXFP4 blocks (gate_up_proj_blocks / _scales)
        raise ModelLoadError(f"{config_path}: quantization_config quant_method={quantization.get('quant_method')!r} "
                             f"is not supported: tokenmill reads gpt-oss experts as float tensors (gate_up_proj, "
                             f"down_proj), not MXFP4 blocks; save the model dequantized first (transformers: "
                             f"Mxfp4Config(dequantize=True), then save_pretrained)")
    attention_bias = bool(raw.get("attention_bias", True))
    return dict(num_experts=int(raw.get("num_local_experts") or 0),
                num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
                moe_intermediate_size=int(raw["intermediate_size"]), router_bias=True, router_topk_first=True,
                expert_bias=True, swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)), attention_sinks=True,
                attention_out_bias=attention_bias)


def hf_moe_fields(raw: dict, architecture: str, num_layers: int, config_path: Path) -> dict:
    """The ModelConfig fields of a mixture of experts ({} for a dense architecture), as transformers reads them."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    if architecture == "gpt_oss":
        return _gpt_oss_fields(raw, config_path)
    if architecture == "olmoe" and raw.get("clip_qkv") is not None:
        raise ModelLoadError(f"{config_path}: olmoe clip_qkv={raw['clip_qkv']} is not supported (only null)")
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    fields = dict(num_experts=num_experts, num_experts_per_tok=int(raw.get("num_experts_per_tok") or 0),
                  qk_norm_whole=architecture == "olmoe")
    if architecture == "mixtral":  # MixtralTopKRouter: always renormalised, the weights kept in float32
        return dict(fields, moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True,
                    router_weights_float=True)
    fields["norm_topk_prob"] = bool(raw.get("norm_topk_prob", False))
    if architecture == "olmoe":
        return dict(fields, moe_intermediate_size=int(raw["intermediate_size"]))
    step = int(raw.get("decoder_sparse_step") or 1)  # Qwen3MoeDecoderLayer's rule for which layers are sparse
    only_mlp = set(raw.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(num_layers) if i in only_mlp or num_experts == 0 or (i + 1) % step != 0)
    return dict(fields, moe_intermediate_size=int(raw.get("moe_intermediate_size") or 768), dense_mlp_layers=dense)


def stored_expert_parts(name: str, num_experts: int) -> list[list[list[str]]]:
    """For an expected stacked MoE tensor (weights.ROUTER / EXPERTS_GATE_UP / EXPERTS_DOWN under a layer prefix),
    the per-expert layouts a folder may store it in instead, each as [per expert: the names concatenated along
    rows]; [] for any other name. The router is one tensor: a layout of one "expert"."""
    prefix, _, suffix = name.partition(".mlp.")
    suffix = f"mlp.{suffix}"

    def per_expert(*parts: str) -> list[list[str]]:
        return [[f"{prefix}.{part.format(e=e)}" for part in parts] for e in range(num_experts)]

    if suffix == ROUTER:
        return [[[f"{prefix}.block_sparse_moe.gate.weight"]]]
    if suffix == EXPERTS_GATE_UP:
        return [per_expert("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
                per_expert("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight")]
    if suffix == EXPERTS_DOWN:
        return [per_expert("mlp.experts.{e}.down_proj.weight"), per_expert("block_sparse_moe.experts.{e}.w2.weight")]
    return []


# GGUF general.architecture of MoE variants that are refused, and what they would need (as UNSUPPORTED_VARIANTS)
UNSUPPORTED_GGUF_VARIANTS = {"deepseek2": "deepseek_v2", "deepseek3": "deepseek_v3", "gpt-oss": "gpt_oss",
                             "qwen2moe": "qwen2_moe", "qwen3next": "qwen3_next", "llama4": "llama4", "dbrx": "dbrx"}
# what a GGUF file of a variant lacks when its Hugging Face folder loads (UNSUPPORTED_VARIANTS has no entry for it)
GGUF_ONLY_MISSING = {
    "gpt_oss": "reader for gpt-oss GGUF files (llama.cpp's converter stores their experts as MXFP4 blocks, a "
               "type tokenmill has no dequantizer or kernel for, and names the sinks, biases and interleaved "
               "gate/up its own way); a gpt-oss Hugging Face folder with float experts loads",
}
# llama.cpp's build_moe_ffn norm_w per architecture (what it does when the file has no expert_weights_norm key)
GGUF_RENORMALISES = {"qwen3_moe": True, "mixtral": True, "olmoe": False}
GGUF_SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX


def refuse_unsupported_gguf_variant(arch: str, path: Path) -> None:
    variant = UNSUPPORTED_GGUF_VARIANTS.get(arch)
    if variant is not None:
        missing = UNSUPPORTED_VARIANTS.get(variant) or GGUF_ONLY_MISSING[variant]
        raise ModelLoadError(f"{path}: GGUF general.architecture {arch!r} is a mixture-of-experts variant that is not "
                             f"supported: tokenmill has no {missing}; supported MoE "
                             f"architectures: qwen3moe, llama with llama.expert_count (Mixtral), olmoe")


def gguf_moe_fields(get, arch: str, model_arch: str, path: Path) -> dict:
    """The ModelConfig fields of a GGUF mixture of experts ({} for a dense one). get(key, default): its metadata."""
    num_experts = int(get(f"{arch}.expert_count", 0) or 0)
    if model_arch not in GGUF_RENORMALISES or num_experts == 0:
        return {}
    if int(get(f"{arch}.expert_shared_count", 0) or 0):
        raise ModelLoadError(f"{path}: {arch}.expert_shared_count={get(f'{arch}.expert_shared_count')}: shared experts "
                             f"are not supported")
    gating = int(get(f"{arch}.expert_gating_func", GGUF_SOFTMAX_GATING))
    scale = float(get(f"{arch}.expert_weights_scale", 1.0) or 1.0)
    if gating != GGUF_SOFTMAX_GATING or scale != 1.0:
        raise ModelLoadError(f"{path}: {arch}.expert_gating_func={gating} / expert_weights_scale={scale}: only softmax "
                             f"gating (1) with scale 1 is supported")
    inter = get(f"{arch}.expert_feed_forward_length") or get(f"{arch}.feed_forward_length")
    return dict(num_experts=num_experts, num_experts_per_tok=int(get(f"{arch}.expert_used_count", 0) or 0),
                moe_intermediate_size=int(inter),
                norm_topk_prob=bool(get(f"{arch}.expert_weights_norm", GGUF_RENORMALISES[model_arch])),
                router_weights_float=model_arch == "mixtral", qk_norm_whole=model_arch == "olmoe")


def gguf_expert_names(hf_name: str) -> tuple[str, ...]:
    """The GGUF tensors [E, rows, cols] behind a stacked expert tensor (concatenated along rows), or () for others."""
    prefix, _, suffix = hf_name.partition(".mlp.")
    block = f"blk.{prefix.rpartition('.')[2]}"
    if f"mlp.{suffix}" == EXPERTS_GATE_UP:
        return f"{block}.ffn_gate_exps.weight", f"{block}.ffn_up_exps.weight"
    if f"mlp.{suffix}" == EXPERTS_DOWN:
        return (f"{block}.ffn_down_exps.weight",)
    return ()
