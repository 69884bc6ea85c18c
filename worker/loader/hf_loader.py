"""Read a Hugging Face model folder: config.json + *.safetensors (single file or sharded with an index)."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from worker.config import ModelConfig
from worker.loader.errors import ModelLoadError
from worker.loader.weights import LM_HEAD, check_shape, expected_hf_shapes

logger = logging.getLogger(__name__)

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
MODEL_TYPES = {arch: arch for arch in ARCHITECTURES.values()}
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


def _rope(raw: dict, config_path: Path) -> float:
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta (+ rope_scaling) at the top level
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ModelLoadError(f"{config_path}: rope type {rope_type!r} is not supported; supported: 'default'")
    return float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))


def _optional_token_id(value) -> int | None:
    if isinstance(value, list):  # some models list several end tokens; the first is the canonical one
        return int(value[0]) if value else None
    return None if value is None else int(value)


def parse_hf_config(raw: dict, config_path: Path, tie_word_embeddings: bool) -> ModelConfig:
    architecture = _architecture(raw, config_path)
    try:
        if raw.get("mlp_bias"):
            raise ModelLoadError(f"{config_path}: mlp_bias=true is not supported")
        if raw.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"{config_path}: hidden_act={raw['hidden_act']!r} is not supported; supported: 'silu'")
        window = raw.get("sliding_window") if raw.get("use_sliding_window", architecture == "mistral") else None
        if window:
            logger.warning("%s: sliding_window=%s is not applied; attention is full-context", config_path, window)
        num_heads = int(raw["num_attention_heads"])
        hidden_size = int(raw["hidden_size"])
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
            rope_theta=_rope(raw, config_path),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=architecture == "qwen2" or bool(raw.get("attention_bias", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            bos_token_id=_optional_token_id(raw.get("bos_token_id")),
            eos_token_id=_optional_token_id(raw.get("eos_token_id")),
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


def read_hf_folder(folder: Path, dtype: torch.dtype, progress: bool) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Returns the config and the checked HF-named tensors in dtype."""
    config_path = folder / "config.json"
    raw = _read_config_json(config_path)
    tensor_files = _tensor_files(folder)
    config = parse_hf_config(raw, config_path, tie_word_embeddings=LM_HEAD not in tensor_files)
    expected = expected_hf_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    handles: dict[Path, object] = {}
    try:
        for name, shape in tqdm(expected.items(), desc=f"loading {folder.name}", unit="tensor", file=sys.stderr, disable=not progress):
            path = tensor_files.get(name)
            if path is None:
                raise ModelLoadError(f"{folder}: tensor {name!r} is missing from the safetensors files")
            if path not in handles:
                if not path.is_file():
                    raise ModelLoadError(f"{path}: listed in {INDEX_FILE} for tensor {name!r} but does not exist")
                handles[path] = _open(path)
            handle = handles[path]
            check_shape(str(path), name, tuple(handle.get_slice(name).get_shape()), shape)
            tensors[name] = handle.get_tensor(name).to(dtype)
    finally:
        handles.clear()
    return config, tensors
