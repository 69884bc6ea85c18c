"""Read a llama.cpp GGUF file (or a split set of them): config from its metadata, tensors dequantized
and renamed to Hugging Face names.

Tensor names are the converter's own table (gguf.get_tensor_name_map, what convert_hf_to_gguf.py
names each HF tensor with), per architecture. Layout differences the converter introduces, undone here:
  - llama (and Mistral, which it writes as llama): attn_q / attn_k rows permuted for its interleaved
    rotary layout, w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2) (k uses n_kv_heads);
    the other families use the NeoX layout, which is HF's, and are stored as they are;
  - gemma2/3: norm weights stored as 1 + w (the model's build step is told so);
  - llama3 rope scaling: stored as per-frequency divisors (rope_freqs), phi3 longrope as
    rope_factors_short / rope_factors_long plus an attention factor.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Collection
from functools import cache
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from worker.linears.ggml_blocks import GGMLBlocksWeight, block_supported
from worker.linears.ggml_experts import ExpertBlocksWeight
from worker.linears.group_quant import GroupQuantWeight
from worker.loader.errors import ModelLoadError
from worker.loader.gguf_quants import ggml_blocks_from_gguf, group_quant_from_gguf
from worker.loader.moe import gguf_expert_names, gguf_moe_fields, refuse_unsupported_gguf_variant
from worker.loader.weights import (EMBEDDING, EXPERTS_DOWN, EXPERTS_GATE_UP, LINEAR_WEIGHTS, LM_HEAD, check_shape,
                                   expected_hf_shapes)
from worker.model.config import ModelConfig, RopeScaling

QuantizedWeight = GroupQuantWeight | GGMLBlocksWeight

# GGUF general.architecture -> ours (llama.cpp's converter writes Mistral 7B as "llama")
SUPPORTED_GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                                "gemma3": "gemma3", "phi3": "phi3", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
PERMUTED_ROTARY = ("llama",)  # the only converter classes that permute q/k rows
SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
# llama.cpp's 27B rule: gemma 27B scales queries by (hidden / heads) ** -0.5, others by head_dim ** -0.5
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
GEMMA_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}  # every n-th layer is global, as llama.cpp sets them


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation. weight: [rows, cols] with rows = num_heads * head_dim."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@cache
def _tensor_name_map(gguf_arch: str, num_layers: int):
    # built once per (architecture, layer count): each build walks gguf's whole table for every layer, ~16 ms,
    # and a load names every tensor (272 on the default model: 4.4 of its 12 s); the map is only read after
    import gguf

    return gguf.get_tensor_name_map(gguf.MODEL_ARCH[gguf_arch.upper()], num_layers)


def hf_to_gguf_name(gguf_arch: str, num_layers: int, hf_name: str) -> str:
    """The converter's name for an HF tensor name (weight / bias suffix kept)."""
    name = _tensor_name_map(gguf_arch, num_layers).get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ModelLoadError(f"no GGUF name for tensor {hf_name!r} in architecture {gguf_arch!r}")
    return name


class _Metadata:
    def __init__(self, reader, path: Path) -> None:
        self.reader, self.path = reader, path

    def get(self, key: str, default=None, required: bool = False):
        field = self.reader.fields.get(key)
        if field is None:
            if required:
                raise ModelLoadError(f"{self.path}: GGUF metadata key {key!r} is missing")
            return default
        return field.contents()


def _rope_scaling(meta: _Metadata, arch: str, tensors: dict) -> RopeScaling | None:
    if "rope_freqs.weight" in tensors:  # llama3: llama.cpp divides each frequency by its factor
        factors = _dequantize(tensors["rope_freqs.weight"], meta.path).reshape(-1)
        return RopeScaling("freq_factors", freq_factors=tuple(float(f) for f in factors))
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if "rope_factors_long.weight" in tensors:  # phi3 longrope / su
        long = _dequantize(tensors["rope_factors_long.weight"], meta.path).reshape(-1)
        short = _dequantize(tensors["rope_factors_short.weight"], meta.path).reshape(-1)
        return RopeScaling("longrope", original_max_position_embeddings=int(original),
                           attention_factor=float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0)),
                           short_factor=tuple(float(f) for f in short), long_factor=tuple(float(f) for f in long))
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return RopeScaling("linear", factor=factor)
    if kind == "yarn":
        return RopeScaling("yarn", factor=factor, original_max_position_embeddings=int(original))
    raise ModelLoadError(f"{meta.path}: GGUF rope scaling type {kind!r} is not supported; supported: none, linear, yarn")


def _layer_windows(meta: _Metadata, arch: str, model_arch: str, num_layers: int) -> tuple[int | None, ...]:
    window = meta.get(f"{arch}.attention.sliding_window")
    if not window:
        return ()
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # per layer: True where the layer slides
        return tuple(int(window) if sliding else None for sliding in pattern)
    if model_arch in GEMMA_SLIDING_PATTERN:
        every = int(pattern or GEMMA_SLIDING_PATTERN[model_arch])
        return tuple(None if (i + 1) % every == 0 else int(window) for i in range(num_layers))
    return (int(window),) * num_layers


def parse_gguf_config(reader, path: Path, tensors: dict) -> ModelConfig:
    meta = _Metadata(reader, path)
    arch = meta.get("general.architecture", required=True)
    refuse_unsupported_gguf_variant(arch, path)
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF general.architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    model_arch = SUPPORTED_GGUF_ARCHITECTURES[arch]
    if arch == "llama" and meta.get("llama.expert_count"):  # the converter writes Mixtral as llama with experts
        model_arch = "mixtral"
    hidden_size = int(meta.get(f"{arch}.embedding_length", required=True))
    num_heads = int(meta.get(f"{arch}.attention.head_count", required=True))
    num_layers = int(meta.get(f"{arch}.block_count", required=True))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count") or hidden_size // num_heads)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab_default = len(tokens.data) if tokens is not None else None
    eos, bos = meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.bos_token_id")
    gemma = model_arch in GEMMA_SLIDING_PATTERN
    query_scale = meta.get(f"{arch}.attention.scale")
    if query_scale is None and gemma and num_layers == GEMMA_27B_LAYERS[model_arch]:
        query_scale = (hidden_size / num_heads) ** -0.5
    attn_softcap, final_softcap = meta.get(f"{arch}.attn_logit_softcapping"), meta.get(f"{arch}.final_logit_softcapping")
    return ModelConfig(
        architecture=model_arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_default, required=vocab_default is None)),
        hidden_size=hidden_size,
        intermediate_size=int(meta.get(f"{arch}.feed_forward_length", required=True)),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 4096)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        rope_scaling=_rope_scaling(meta, arch, tensors),
        local_rope_theta=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)) if model_arch == "gemma3" else None,
        layer_windows=_layer_windows(meta, arch, model_arch, num_layers),
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        sandwich_norms=gemma,
        hidden_act="gelu_tanh" if gemma else "silu",
        embedding_multiplier=hidden_size**0.5 if gemma else None,
        attn_logit_softcap=None if attn_softcap is None else float(attn_softcap),
        final_logit_softcap=None if final_softcap is None else float(final_softcap),
        query_scale=None if query_scale is None else float(query_scale),
        **gguf_moe_fields(meta.get, arch, model_arch, path),
    )


def _dequantize(tensor, path: Path) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        values = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(f"{path}: tensor {tensor.name!r}: {exc}") from None
    # GGUF lists dims innermost first; torch wants them outermost first
    return values.reshape([int(d) for d in reversed(tensor.shape.tolist())])


def _open(path: Path):
    from worker.loader.gguf_reader import FastGGUFReader

    try:
        return FastGGUFReader(str(path))
    except Exception as exc:  # GGUFReader raises ValueError / struct errors / OSError on a bad file
        raise ModelLoadError(f"{path}: not a readable GGUF file: {exc}") from None


def _split_readers(path: Path, first) -> list:
    """All readers of a split model (gguf-split's NAME-0000i-of-0000n.gguf), path being any of them."""
    count = _Metadata(first, path).get("split.count", 1)
    if int(count) <= 1:
        return [first]
    match = SPLIT_NAME.match(path.name)
    if match is None:
        raise ModelLoadError(f"{path}: GGUF split.count is {count} but the name is not NAME-0000i-of-0000n.gguf")
    readers = []
    for index in range(1, int(count) + 1):
        part = path.with_name(f"{match['prefix']}-{index:05d}-of-{int(count):05d}.gguf")
        if not part.is_file():
            raise ModelLoadError(f"{path}: split part {part.name} ({index} of {count}) does not exist")
        readers.append(first if part == path else _open(part))
    return readers


def read_gguf(path: Path, dtype: torch.dtype, progress: bool, keep_quantized: bool = False,
              block_types: Collection[str] = (), expert_block_types: Collection[str] | None = None
              ) -> tuple[ModelConfig, dict[str, torch.Tensor | GroupQuantWeight | GGMLBlocksWeight]]:
    """Returns the config and the checked, dequantized, un-permuted HF-named tensors in dtype (gemma
    norms still holding their 1, as the converter stored them). keep_quantized: the linear weights the
    file holds in a format worker.loader.gguf_quants maps are returned as GroupQuantWeight instead (a tied
    embedding also gives lm_head its quantized copy). block_types (with keep_quantized, CPU): a tensor
    in one of these GGML types with a block kernel (worker.linears.ggml_blocks) is returned as the file's
    mapped blocks; expert_block_types: the same for a MoE layer's experts, where they differ (None: block_types)."""
    first = _open(path)
    expert_block_types = block_types if expert_block_types is None else expert_block_types
    readers = _split_readers(path, first)
    by_gguf_name = {tensor.name: tensor for reader in readers for tensor in reader.tensors}
    # metadata lives in the first part; path may name any part
    meta_reader = next((r for r in readers if r.fields.get("general.architecture") is not None), first)
    try:
        config = parse_gguf_config(meta_reader, path, by_gguf_name)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"{path}: bad GGUF metadata: {exc}") from None
    gguf_arch = meta_reader.fields["general.architecture"].contents()
    tensors: dict[str, torch.Tensor] = {}
    expected = expected_hf_shapes(config)
    for hf_name, shape in tqdm(expected.items(), desc=f"loading {path.name}", unit="tensor", file=sys.stderr, disable=not progress):
        if gguf_expert_names(hf_name):  # a MoE layer's stacked experts: the file's blocks, or dequantized to dtype
            names = gguf_expert_names(hf_name)
            on_blocks = keep_quantized and _experts_on_blocks(by_gguf_name, hf_name, expert_block_types)
            tensors[hf_name] = (_expert_blocks if on_blocks else _experts)(by_gguf_name, names, shape, path, dtype)
            continue
        gguf_name = hf_to_gguf_name(gguf_arch, config.num_layers, hf_name)
        tensor = by_gguf_name.get(gguf_name)
        if tensor is None:
            raise ModelLoadError(f"{path}: tensor {gguf_name!r} is missing from the GGUF file")
        keep = keep_quantized and (hf_name.endswith(LINEAR_WEIGHTS) or hf_name == EMBEDDING)
        quantized = (ggml_blocks_from_gguf(tensor, block_types) if keep else None) or (
            group_quant_from_gguf(tensor) if keep else None)
        if quantized is not None:
            check_shape(str(path), tensor.name, (quantized.out_features, quantized.in_features), shape)
            tensors[hf_name] = _unpermuted(quantized, gguf_arch, hf_name, config)
            continue
        values = _dequantize(tensor, path)
        check_shape(str(path), tensor.name, values.shape, shape)
        if gguf_arch in PERMUTED_ROTARY and hf_name.endswith("q_proj.weight"):
            values = unpermute_rotary_rows(values, config.num_heads)
        elif gguf_arch in PERMUTED_ROTARY and hf_name.endswith("k_proj.weight"):
            values = unpermute_rotary_rows(values, config.num_kv_heads)
        tensors[hf_name] = torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)
    if config.tie_word_embeddings and isinstance(tensors[EMBEDDING], (GroupQuantWeight, GGMLBlocksWeight)):
        tensors[LM_HEAD] = tensors[EMBEDDING]  # one set of codes behind the lookup and the matmul
    return config, tensors


def _experts(by_gguf_name: dict, names: tuple[str, ...], shape: tuple[int, ...], path: Path,
             dtype: torch.dtype) -> torch.Tensor:
    """ffn_{gate,up}_exps (concatenated along each expert's rows) or ffn_down_exps: [E, rows, cols] in dtype."""
    parts = []
    for name in names:
        if name not in by_gguf_name:
            raise ModelLoadError(f"{path}: tensor {name!r} is missing from the GGUF file")
        parts.append(torch.from_numpy(np.array(_dequantize(by_gguf_name[name], path), dtype=np.float32)))
    stacked = torch.cat(parts, dim=1)
    check_shape(str(path), " + ".join(names), tuple(stacked.shape), shape)
    return stacked.to(dtype)


def _experts_on_blocks(by_gguf_name: dict, hf_name: str, block_types: Collection[str]) -> bool:
    """Whether a MoE layer's experts stay in the file's blocks: all three of its ffn_{gate,up,down}_exps in types
    block_types runs (--cpu-block-kernels) at their row lengths; a layer never mixes blocks and floats."""
    layer = hf_name.partition(".mlp.")[0]
    names = [name for suffix in (EXPERTS_GATE_UP, EXPERTS_DOWN) for name in gguf_expert_names(f"{layer}.{suffix}")]
    tensors = [by_gguf_name.get(name) for name in names]
    return all(tensor is not None and tensor.tensor_type.name in block_types and
               block_supported(tensor.tensor_type.name, int(tensor.shape[0])) for tensor in tensors)


def _expert_blocks(by_gguf_name: dict, names: tuple[str, ...], shape: tuple[int, ...], path: Path,
                   dtype: torch.dtype) -> ExpertBlocksWeight:
    """ffn_{gate,up}_exps (two parts of one weight) or ffn_down_exps as the file maps them: no copy."""
    num_experts, _, in_features = shape
    parts = [(by_gguf_name[name].tensor_type.name, np.asarray(by_gguf_name[name].data).view(np.uint8)) for name in names]
    weight = ExpertBlocksWeight.from_blocks(parts, num_experts, in_features)
    check_shape(str(path), " + ".join(names), (weight.num_experts, weight.out_features, weight.in_features), shape)
    return weight


def _unpermuted(weight: QuantizedWeight, gguf_arch: str, hf_name: str, config: ModelConfig) -> QuantizedWeight:
    """llama.cpp's q/k row order undone on the codes, scales and minimums (a row permutation)."""
    if gguf_arch not in PERMUTED_ROTARY or not hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        return weight
    heads = config.num_heads if hf_name.endswith("q_proj.weight") else config.num_kv_heads
    order = unpermute_rotary_rows(np.arange(weight.out_features)[:, None], heads)[:, 0]
    return weight.rows(torch.from_numpy(np.ascontiguousarray(order)))
