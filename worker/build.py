"""Model + KV cache + runner from plain settings: shared by the worker process and the in-process engine."""
from __future__ import annotations

from pathlib import Path

import torch

from worker.backends import ExecutionOptions
from worker.kv_cache import num_blocks_for_budget
from worker.loader import default_model_path, load_model
from worker.model_runner import ModelRunner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str) -> torch.device:
    """auto: the GPU when torch sees one, else the CPU."""
    if name not in DEVICES:
        raise ValueError(f"device={name!r} is not one of {list(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return torch.device(name)


def build_runner(model: str | Path | None, dtype: str, block_size: int, kv_cache_bytes: int,
                 num_blocks: int | None = None, progress: bool = True, device: str = "cpu",
                 options: ExecutionOptions = ExecutionOptions()) -> ModelRunner:
    """Loads the model (None: the default GGUF) onto the device, quantizes its linears if asked, and
    sizes the KV cache from the memory budget."""
    torch_dtype = resolve_dtype(dtype)
    torch_device = resolve_device(device)
    path = Path(model) if model else default_model_path()
    network, config = load_model(path, dtype=torch_dtype, progress=progress)
    network = network.to(torch_device)
    if options.quantization == "int8":
        from worker.quantization import quantize_linears_int8

        quantize_linears_int8(network, use_kernel=torch_device.type == "cuda")
    num_blocks = num_blocks or num_blocks_for_budget(config, torch_dtype, block_size, kv_cache_bytes)
    return ModelRunner(network, config, num_blocks=num_blocks, block_size=block_size, dtype=torch_dtype,
                       options=options)


def model_name(model: str | Path | None) -> str:
    path = Path(model) if model else default_model_path()
    return path.stem if path.suffix == ".gguf" else path.name
