"""Model + KV cache + runner from plain settings: shared by the worker process and the in-process engine."""
from __future__ import annotations

from pathlib import Path

import torch

from worker.kv_cache import num_blocks_for_budget
from worker.loader import default_model_path, load_model
from worker.model_runner import ModelRunner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def build_runner(model: str | Path | None, dtype: str, block_size: int, kv_cache_bytes: int,
                 num_blocks: int | None = None, progress: bool = True) -> ModelRunner:
    """Loads the model (None: the default GGUF) and sizes the KV cache from the memory budget."""
    torch_dtype = resolve_dtype(dtype)
    path = Path(model) if model else default_model_path()
    network, config = load_model(path, dtype=torch_dtype, progress=progress)
    num_blocks = num_blocks or num_blocks_for_budget(config, torch_dtype, block_size, kv_cache_bytes)
    return ModelRunner(network, config, num_blocks=num_blocks, block_size=block_size, dtype=torch_dtype)


def model_name(model: str | Path | None) -> str:
    path = Path(model) if model else default_model_path()
    return path.stem if path.suffix == ".gguf" else path.name
