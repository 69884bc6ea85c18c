"""Read a Hugging Face model folder: config.json + *.safetensors (single file or sharded with an index)."""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from worker.loader.errors import ModelLoadError
from worker.loader.moe import hf_moe_fields, refuse_unsupported_variant, stored_expert_parts
from worker.loader.share import TensorShare, cut
from worker.loader.weights import LM_HEAD, check_shape, expected_hf_shapes
from worker.model.config import ModelConfig, RopeScaling


ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",  # the text-only model; Gemma3ForConditionalGeneration (vision) is refused
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",  # mixtures of experts (worker.model.moe)
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt_oss",
}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
               "gemma3_text": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3_moe", "mixtral": "mixtral",
               "olmoe": "olmoe", "gpt_oss": "gpt_oss"}
QK_NORM_ARCHITECTURES = ("qwen3", "gemma3", "qwen3_moe", "olmoe")  # olmoe's span the whole projection
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
GEMMA = ("gemma2", "gemma3")
INDEX_FILE = "model.safetensors.index.json"


def _read_config_json(config_path: Path) -> dict:
    if not config_path.is_file():
        raise ModelLoadError(f"{config_path.parent}: not a Hugging Face model folder (no config.json)")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{config_path}: malformed JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _architecture(raw: dict, config_path: Path) -> str:
    refuse_unsupported_variant(raw, config_path)
    names = raw.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if not names and raw.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[raw["model_type"]]
    found = names[0] if names else raw.get("model_type")
    raise ModelLoadError(
        f"{config_path}: architecture {found!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
    )


def _rope_dicts(raw: dict) -> tuple[dict, dict | None]:
    """(the global layers' rope parameters, the sliding layers' own or None).

    transformers 5 writes rope_parameters (nested by layer type for gemma3); 4.x wrote rope_theta,
    rope_scaling and gemma3's rope_local_base_freq at the top level."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    if isinstance(params, dict) and params:
        return dict(params), None
    rope = dict(raw.get("rope_scaling") or {})
    rope.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    local = {"rope_theta": raw["rope_local_base_freq"]} if "rope_local_base_freq" in raw else None
    return rope, local


def _rope_scaling(rope: dict, raw: dict, config_path: Path) -> RopeScaling | None:
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first name for it
    if float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ModelLoadError(f"{config_path}: partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return None
    max_position = int(raw.get("max_position_embeddings", 4096))
    original = rope.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if original is None and rope_type == "yarn":  # transformers falls back to the model's length
        original = max_position
    factor = rope.get("factor")
    if factor is None and original and rope_type in ("yarn", "longrope"):
        factor = max_position / int(original)  # as transformers derives it
    try:
        return RopeScaling(
            rope_type=rope_type,
            factor=float(1.0 if factor is None else factor),
            original_max_position_embeddings=None if original is None else int(original),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            truncate=bool(rope.get("truncate", True)),
            mscale=rope.get("mscale"),
            mscale_all_dim=rope.get("mscale_all_dim"),
            attention_factor=rope.get("attention_factor"),
            short_factor=tuple(float(f) for f in rope.get("short_factor") or ()),
            long_factor=tuple(float(f) for f in rope.get("long_factor") or ()),
        )
    except ValueError as exc:
        raise ModelLoadError(f"{config_path}: {exc}") from None


def _layer_windows(raw: dict, architecture: str, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers applies them."""
    window = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    if window is None:
        return ()
    if layer_types:  # transformers 5 names each layer's kind
        return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
    if architecture in ("mistral", "phi3", "mixtral"):  # every layer, whenever sliding_window is set
        return (int(window),) * num_layers
    if architecture == "qwen3_moe":  # Qwen3MoeConfig keeps the window only under use_sliding_window, on every layer
        return (int(window),) * num_layers if raw.get("use_sliding_window") else ()
    if architecture == "gemma2":  # 4.x: even layers slide
        return tuple(int(window) if i % 2 == 0 else None for i in range(num_layers))
    if architecture == "gemma3":  # 4.x: every sliding_window_pattern-th layer is global
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple(None if (i + 1) % pattern == 0 else int(window) for i in range(num_layers))
    if raw.get("use_sliding_window"):  # qwen2/3 4.x: layers from max_window_layers on slide
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(int(window) if i >= first else None for i in range(num_layers))
    return ()


def _optional_token_id(value) -> int | None:
    if isinstance(value, list):  # some models list several end tokens; the first is the canonical one
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def parse_hf_config(raw: dict, config_path: Path, tie_word_embeddings: bool) -> ModelConfig:
    architecture = _architecture(raw, config_path)
    try:
        if raw.get("mlp_bias"):
            raise ModelLoadError(f"{config_path}: mlp_bias=true is not supported")
        activation = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        if activation not in ACTIVATIONS:
            raise ModelLoadError(
                f"{config_path}: hidden activation {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
            )
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        num_layers = int(raw["num_hidden_layers"])
        global_rope, local_rope = _rope_dicts(raw)
        if architecture == "gemma3" and local_rope is None:
            local_rope = {"rope_theta": 10000.0}  # transformers' default rope_local_base_freq
        if local_rope is not None and _rope_scaling(local_rope, raw, config_path) is not None:
            raise ModelLoadError(f"{config_path}: rope scaling on sliding-window layers is not supported")
        gemma = architecture in GEMMA
        query_scalar = raw.get("query_pre_attn_scalar")
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rope_theta=float(global_rope.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=architecture == "qwen2" or bool(raw.get("attention_bias", architecture == "gpt_oss")),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            bos_token_id=_optional_token_id(raw.get("bos_token_id")),
            eos_token_id=_optional_token_id(raw.get("eos_token_id")),
            rope_scaling=_rope_scaling(global_rope, raw, config_path),
            local_rope_theta=None if local_rope is None else float(local_rope.get("rope_theta", 10000.0)),
            layer_windows=_layer_windows(raw, architecture, num_layers),
            qk_norm=architecture in QK_NORM_ARCHITECTURES,
            sandwich_norms=gemma,
            hidden_act=ACTIVATIONS[activation],
            embedding_multiplier=hidden_size**0.5 if gemma else None,
            attn_logit_softcap=_optional_float(raw.get("attn_logit_softcapping")),
            final_logit_softcap=_optional_float(raw.get("final_logit_softcapping")),
            query_scale=float(query_scalar) ** -0.5 if gemma and query_scalar else None,
            **hf_moe_fields(raw, architecture, num_layers, config_path),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{config_path}: missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"{config_path}: bad value: {exc}") from None


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own SafetensorError for a bad header
        raise ModelLoadError(f"{path}: not a readable safetensors file: {exc}") from None


def _tensor_files(folder: Path) -> dict[str, Path]:
    """tensor name -> the safetensors file holding it."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index_path}: malformed index ({exc!r})") from None
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (and no {INDEX_FILE})")
    tensor_files: dict[str, Path] = {}
    for path in files:
        tensor_files.update((name, path) for name in _open(path).keys())
    return tensor_files


class _FolderTensors:
    """Reads HF-named tensors from a folder's safetensors files, each file opened once."""

    def __init__(self, folder: Path, tensor_files: dict[str, Path]) -> None:
        self.folder, self.tensor_files = folder, tensor_files
        self.handles: dict[Path, object] = {}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, share: TensorShare | None = None) -> torch.Tensor:
        """The tensor in dtype; with share, only the part share.part(name) names, read from the file as such
        (safetensors slices: the rest of the tensor is never read into memory)."""
        part = None if share is None else share.part(name)
        if name not in self.tensor_files:  # per-expert tensors, stacked: cut after stacking
            tensor = self._stacked(name, shape, dtype)
            return tensor if part is None else cut(tensor, *part)
        check_shape(str(self.tensor_files[name]), name, self.shape(name), shape)
        if part is None:
            return self._handle(name).get_tensor(name).to(dtype)
        dim, ranges = part
        stored = self._handle(name).get_slice(name)
        pieces = [stored[(slice(None),) * dim + (slice(r.start, r.stop),)].to(dtype) for r in ranges]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def _handle(self, name: str):
        path = self.tensor_files.get(name)
        if path is None:
            raise ModelLoadError(f"{self.folder}: tensor {name!r} is missing from the safetensors files")
        if path not in self.handles:
            if not path.is_file():
                raise ModelLoadError(f"{path}: listed in {INDEX_FILE} for tensor {name!r} but does not exist")
            self.handles[path] = _open(path)
        return self.handles[path]

    def _stacked(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A MoE tensor the folder stores per expert (worker.loader.moe.stored_expert_parts): stacked over experts."""
        layouts = stored_expert_parts(name, shape[0])
        layout = next((parts for parts in layouts if parts[0][0] in self.tensor_files), None)
        if layout is None:
            raise ModelLoadError(f"{self.folder}: tensor {name!r} is missing from the safetensors files"
                                 + (f" (nor is it stored per expert as {layouts[0][0][0]!r}, ...)" if layouts else ""))
        experts = [torch.cat([self._handle(part).get_tensor(part).to(dtype) for part in parts]) for parts in layout]
        tensor = torch.stack(experts) if len(shape) == 3 else experts[0]  # [E, rows, cols]; the router is one tensor
        check_shape(str(self.folder), f"{name} (from {layout[0][0]!r}, ...)", tuple(tensor.shape), shape)
        return tensor


def read_hf_folder(folder: Path, dtype: torch.dtype, progress: bool,
                   share_of: Callable[[ModelConfig], TensorShare] | None = None
                   ) -> tuple[ModelConfig, dict[str, torch.Tensor], TensorShare | None]:
    """Returns the config, the checked HF-named tensors in dtype (a MoE layer's experts stacked) and, with
    share_of, the share they were cut to (share_of(config): a tensor-parallel rank's)."""
    config_path = folder / "config.json"
    raw = _read_config_json(config_path)
    tensor_files = _tensor_files(folder)
    config = parse_hf_config(raw, config_path, tie_word_embeddings=LM_HEAD not in tensor_files)
    expected = expected_hf_shapes(config)
    share = None if share_of is None else share_of(config)
    reader = _FolderTensors(folder, tensor_files)
    try:
        tensors = {name: reader.read(name, shape, dtype, share) for name, shape in
                   tqdm(expected.items(), desc=f"loading {folder.name}", unit="tensor", file=sys.stderr,
                        disable=not progress)}
    finally:
        reader.handles.clear()
    if share is not None:
        tensors = {name: share.pad(name, tensor) for name, tensor in tensors.items()}
    return config, tensors, share
