"""Write a tiny transformers model as llama.cpp's convert_hf_to_gguf.py would: its tensor names (the
gguf package's own name map), its layouts (q/k rows permuted for llama only, gemma norms stored as
1 + w, llama3 scaling as a rope_freqs tensor, phi3 longrope as rope_factors_* tensors) and its
metadata keys. F32 tensors, so the file holds exactly the HF model's weights.
"""
from __future__ import annotations

import math

import numpy as np

from tokenmill.bench.gguf_hparams import rope_parameters, write_hparams

# transformers model_type -> GGUF general.architecture, as the converter registers them
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                      "gemma3_text": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe", "mixtral": "llama",
                      "olmoe": "olmoe"}


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """As in llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute)."""
    return weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


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
    rope = rope_parameters(config)
    write_hparams(writer, config)
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


def quantized_blocks(values: np.ndarray, type_name: str, seed: int = 0) -> np.ndarray:
    """values [N, K] as a GGUF quantized tensor's raw bytes [N, row bytes]. gguf-py quantizes Q4_0 / Q4_1 /
    Q5_0 / Q5_1 / Q8_0; it has no K-quant quantizer, so those get random codes under small random f16 scales (a valid
    file whose weights are what the blocks say, which is all a loader test needs)."""
    import gguf
    from gguf.quants import quantize

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return quantize(values.astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (values.size // block, size), dtype=np.uint8)
    scale_at = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[type_name]  # d (and dmin) f16 fields
    for offset in scale_at:
        blocks[:, offset:offset + 2] = rng.uniform(0, 2e-3, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(values.shape[0], -1)


def _write_byte_tokenizer(writer) -> None:
    """tiny_models' tokenizer as a gpt2 GGUF vocabulary (the 256 byte symbols, <s>, </s>), enough for llama.cpp to
    load the file; one merge, since llama.cpp refuses a gpt2 vocabulary without merges."""
    from tokenizers import pre_tokenizers

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<s>", "</s>"])
    writer.add_token_types([1] * 256 + [3, 3])  # normal, then control
    writer.add_token_merges(["a b"])


def write_converter_gguf(path, hf_model, skip: tuple[str, ...] = (), architecture: str | None = None,
                         split_max_tensors: int = 0, quantize: dict[str, str] | None = None,
                         tokenizer: bool = False) -> None:
    """split_max_tensors > 0: gguf-split's layout, path's stem + -0000i-of-0000n.gguf, metadata in the first.
    quantize: GGUF tensor-name suffix (e.g. "attn_q.weight") -> the GGML type it is stored in. tokenizer: also
    write tiny_models' byte vocabulary (what llama-server needs to load the file)."""
    import gguf

    config = hf_model.config
    arch = architecture or GGUF_ARCHITECTURES[config.model_type]
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    _write_metadata(writer, config, arch)
    if tokenizer:
        _write_byte_tokenizer(writer)
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[GGUF_ARCHITECTURES[config.model_type].upper()], config.num_hidden_layers)
    state = hf_model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # llama.cpp writes no output.weight for tied models
    rope = rope_parameters(config)
    tensors = {}
    if rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = _llama3_rope_factors(rope, config.head_dim)
    if rope.get("rope_type") == "longrope":
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    for hf_name, tensor in state.items():
        gguf_name = tensor_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        values = tensor.detach().float().numpy()
        if hf_name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):  # stacked [E, rows, cols]
            block = "blk." + hf_name.split(".")[2]
            if hf_name.endswith("down_proj"):
                tensors[f"{block}.ffn_down_exps.weight"] = values
            else:
                gate, up = np.split(values, 2, axis=1)
                tensors[f"{block}.ffn_gate_exps.weight"], tensors[f"{block}.ffn_up_exps.weight"] = gate, up
            continue
        if arch == "llama" and gguf_name.endswith("attn_q.weight"):
            values = llama_cpp_permute(values, config.num_attention_heads)
        elif arch == "llama" and gguf_name.endswith("attn_k.weight"):
            values = llama_cpp_permute(values, config.num_key_value_heads)
        elif arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            values = values + 1  # Gemma*Model.modify_tensors
        tensors[gguf_name] = values
    for name, values in tensors.items():
        if name in skip:
            continue
        type_name = next((t for suffix, t in (quantize or {}).items() if name.endswith(suffix)), None)
        if type_name is None:
            writer.add_tensor(name, np.ascontiguousarray(values))
        else:
            import gguf

            rows = values.reshape(-1, values.shape[-1])  # a stacked expert tensor [E, rows, cols] row by row
            raw = quantized_blocks(rows, type_name, seed=len(name)).reshape(*values.shape[:-1], -1)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
