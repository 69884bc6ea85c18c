"""Read a llama.cpp GGUF file: config from its metadata, tensors dequantized and renamed to HF names.

llama.cpp's convert script permutes the rows of attn_q / attn_k for its interleaved rotary layout:
    w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)
We invert that so the HF "rotate_half" RoPE applies unchanged (k uses n_kv_heads).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from worker.config import ModelConfig
from worker.loader.errors import ModelLoadError
from worker.loader.weights import check_shape, expected_hf_shapes

SUPPORTED_GGUF_ARCHITECTURES = ("llama",)

_LAYER_TENSORS = {  # GGUF name inside blk.N -> HF name inside model.layers.N
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def gguf_to_hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    return None  # e.g. rope_freqs: not used by this model


def hf_to_gguf_name(hf_name: str) -> str:
    for gguf_name, name in _GLOBAL_TENSORS.items():
        if name == hf_name:
            return gguf_name
    _, _, layer, inner = hf_name.split(".", 3)  # model.layers.N.<inner>
    return f"blk.{layer}." + next(g for g, h in _LAYER_TENSORS.items() if h == inner)


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation. weight: [rows, cols] with rows = num_heads * head_dim."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _field(reader, key: str, path: Path, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ModelLoadError(f"{path}: GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def parse_gguf_config(reader, path: Path, tensor_names: set[str]) -> ModelConfig:
    arch = _field(reader, "general.architecture", path)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF general.architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    hidden_size = int(_field(reader, f"{arch}.embedding_length", path))
    num_heads = int(_field(reader, f"{arch}.attention.head_count", path))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_default = len(tokens.data) if tokens is not None else None
    eos = reader.fields.get("tokenizer.ggml.eos_token_id")
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture="llama",
        vocab_size=int(_field(reader, f"{arch}.vocab_size", path, vocab_default)),
        hidden_size=hidden_size,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length", path)),
        num_layers=int(_field(reader, f"{arch}.block_count", path)),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", path, num_heads)),
        head_dim=int(_field(reader, f"{arch}.rope.dimension_count", path, hidden_size // num_heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", path, 10000.0)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", path, 1e-5)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=False,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", path, 4096)),
        bos_token_id=None if bos is None else int(bos.contents()),
        eos_token_id=None if eos is None else int(eos.contents()),
    )


def _dequantize(tensor, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name!r}: {exc}") from None
    # GGUF lists dims innermost first; torch wants them outermost first
    return values.reshape([int(d) for d in reversed(tensor.shape.tolist())])


def read_gguf(path: Path, dtype: torch.dtype, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Returns the config and the checked, dequantized, un-permuted HF-named tensors in dtype."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # GGUFReader raises ValueError / struct errors / OSError on a bad file
        raise ModelLoadError(f"{path}: not a readable GGUF file: {exc}") from None
    by_hf_name = {gguf_to_hf_name(t.name): t for t in reader.tensors}
    try:
        config = parse_gguf_config(reader, path, {t.name for t in reader.tensors})
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"{path}: bad GGUF metadata: {exc}") from None
    tensors: dict[str, torch.Tensor] = {}
    expected = expected_hf_shapes(config)
    for hf_name, shape in tqdm(expected.items(), desc=f"loading {path.name}", unit="tensor", file=sys.stderr, disable=not progress):
        tensor = by_hf_name.get(hf_name)
        if tensor is None:
            raise ModelLoadError(f"{path}: tensor {hf_to_gguf_name(hf_name)!r} is missing from the GGUF file")
        values = _dequantize(tensor, path)
        check_shape(str(path), tensor.name, values.shape, shape)
        if hf_name.endswith("q_proj.weight"):
            values = unpermute_rotary_rows(values, config.num_heads)
        elif hf_name.endswith("k_proj.weight"):
            values = unpermute_rotary_rows(values, config.num_kv_heads)
        tensors[hf_name] = torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)
    return config, tensors
