"""Write a tiny transformers model as llama.cpp's convert_hf_to_gguf.py would: its tensor names (the
gguf package's own name map), its layouts (q/k rows permuted for llama only, gemma norms stored as
1 + w, llama3 scaling as a rope_freqs tensor, phi3 longrope as rope_factors_* tensors) and its
metadata keys. F32 tensors, so the file holds exactly the HF model's weights.
"""
from __future__ import annotations

import math

import numpy as np

# transformers model_type -> GGUF general.architecture, as the converter registers them
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                      "gemma3_text": "gemma3", "phi3": "phi3"}


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """As in llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute)."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _rope(config) -> dict:
    params = dict(config.rope_parameters)
    return params.get("full_attention", params)


def _llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: one divisor per frequency."""
    base, factor = rope["rope_theta"], rope["factor"]
    low_freq_factor, high_freq_factor = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context_len = rope["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_metadata(writer, config, arch: str) -> None:
    rope = _rope(config)
    head_dim = config.head_dim
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    rope_type = rope.get("rope_type", "default")
    if rope_type in ("linear", "yarn"):
        import gguf

        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR if rope_type == "linear" else gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        if rope_type == "yarn":
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "phi3" and rope_type == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_rope_scaling_orig_ctx_len(original)
    if getattr(config, "sliding_window", None) and arch in ("gemma2", "gemma3", "phi3"):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)


def write_converter_gguf(path, hf_model, skip: tuple[str, ...] = (), architecture: str | None = None,
                         split_max_tensors: int = 0) -> None:
    """split_max_tensors > 0: gguf-split's layout, path's stem + -0000i-of-0000n.gguf, metadata in the first."""
    import gguf

    config = hf_model.config
    arch = architecture or GGUF_ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    _write_metadata(writer, config, arch)
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[GGUF_ARCHITECTURES[config.model_type].upper()], config.num_hidden_layers)
    state = hf_model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # llama.cpp writes no output.weight for tied models
    rope = _rope(config)
    tensors = {}
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = _llama3_rope_factors(rope, config.head_dim)
    if rope.get("rope_type") == "longrope":
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    for hf_name, tensor in state.items():
        gguf_name = tensor_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        values = tensor.detach().float().numpy()
        if arch == "llama" and gguf_name.endswith("attn_q.weight"):
            values = llama_cpp_permute(values, config.num_attention_heads)
        elif arch == "llama" and gguf_name.endswith("attn_k.weight"):
            values = llama_cpp_permute(values, config.num_key_value_heads)
        elif arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            values = values + 1  # Gemma*Model.modify_tensors
        tensors[gguf_name] = values
    for name, values in tensors.items():
        if name not in skip:
            writer.add_tensor(name, np.ascontiguousarray(values))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
