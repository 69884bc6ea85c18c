"""Model + KV cache + runner from plain settings: shared by the worker process and the in-process engine."""
from __future__ import annotations

from pathlib import Path

import torch

from plumbing.grammar import GrammarCompiler
from worker.backends import ExecutionOptions
from worker.group_quant import quantize_linears
from worker.kv_cache import bytes_per_block
from worker.kv_sizing import (KVCacheSizing, default_memory_fraction, free_memory_bytes, measure_activation_peak,
                               profile_batch, read_sizing_record, size_from_budget, size_from_memory_or_record,
                               write_sizing_record)
from worker.loader import default_model_path, load_model
from worker.model_runner import ModelRunner
from worker.native_ops import cpu_has_native_bf16
from worker.structured_output import StructuredOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bfloat16 (avx512_bf16 / AMX), float32 otherwise."""
    if name == "auto":
        native = torch.device(device).type == "cuda" or cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not one of {list(DTYPE_CHOICES)}")
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


def build_runner(model: str | Path | None, dtype: str, block_size: int, kv_cache_bytes: int | None,
                 num_blocks: int | None = None, progress: bool = True, device: str = "cpu",
                 options: ExecutionOptions = ExecutionOptions(), memory_fraction: float | None = None,
                 profile_tokens: int = 512, swap_space_bytes: int = 0) -> ModelRunner:
    return build_sized_runner(model, dtype, block_size, kv_cache_bytes, num_blocks, progress, device, options,
                              memory_fraction, profile_tokens, swap_space_bytes)[0]


def build_sized_runner(model: str | Path | None, dtype: str, block_size: int, kv_cache_bytes: int | None,
                       num_blocks: int | None = None, progress: bool = True, device: str = "cpu",
                       options: ExecutionOptions = ExecutionOptions(), memory_fraction: float | None = None,
                       profile_tokens: int = 512, swap_space_bytes: int = 0, *, sizing_record: Path | None = None,
                       free_bytes: int | None = None) -> tuple[ModelRunner, KVCacheSizing]:
    """Loads the model (None: the default GGUF) onto the device, quantizes its linears if asked, and
    sizes the KV cache: num_blocks, else kv_cache_bytes, else memory_fraction (None: the device's
    default) of the memory left after the weights and a profile pass of profile_tokens tokens (free_bytes:
    that memory as given, None: measured), reusing the page count in sizing_record when it has one for
    these settings (worker.kv_sizing). swap_space_bytes of host memory become the swap tier's pages."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    path = Path(model) if model else default_model_path()
    network, config = load_model(path, dtype=torch_dtype, progress=progress, keep_quantized=options.quantization == "auto")
    network = network.to(torch_device)
    if options.quantization == "int8" and torch_device.type == "cuda":
        from worker.quantization import quantize_linears_int8

        quantize_linears_int8(network, use_kernel=True)  # the Triton kernel's per-channel format
    elif options.quantization in ("int8", "int4"):
        quantize_linears(network, bits=int(options.quantization.removeprefix("int")))
    per_block = bytes_per_block(config, torch_dtype, block_size)
    if num_blocks:
        sizing = KVCacheSizing(num_blocks, num_blocks * per_block, f"--num-blocks {num_blocks}")
    elif kv_cache_bytes:
        sizing = size_from_budget(kv_cache_bytes, per_block)
    else:
        fraction = memory_fraction if memory_fraction is not None else default_memory_fraction(torch_device)
        settings = (f"model={path.resolve()} dtype={str(torch_dtype).removeprefix('torch.')} device={torch_device} "
                    f"block_size={block_size} fraction={fraction:g} profile_tokens={profile_tokens} {options}")
        peak = _activation_peak(network, config, torch_dtype, torch_device, block_size, options, profile_tokens)
        record = read_sizing_record(sizing_record) if sizing_record else None
        sizing, new_record = size_from_memory_or_record(
            record, settings, free_memory_bytes(torch_device) if free_bytes is None else free_bytes, peak,
            fraction, per_block, torch_device)
        if sizing_record and new_record:
            write_sizing_record(sizing_record, new_record)
    runner = ModelRunner(network, config, num_blocks=sizing.num_blocks, block_size=block_size, dtype=torch_dtype,
                         options=options, num_host_blocks=swap_space_bytes // per_block)
    runner.structured_output = StructuredOutput(GrammarCompiler(path))
    return runner, sizing


def _activation_peak(network, config, dtype: torch.dtype, device: torch.device, block_size: int,
                     options: ExecutionOptions, profile_tokens: int) -> int:
    """The profile pass's peak: a throw-away runner over just the pages the profile step needs."""
    profile = profile_batch(profile_tokens, block_size)
    probe = ModelRunner(network, config, num_blocks=len(profile.spans[0].block_table), block_size=block_size,
                        dtype=dtype, options=options)
    peak = measure_activation_peak(probe.execution_path, profile, device)
    del probe
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peak


def model_name(model: str | Path | None) -> str:
    path = Path(model) if model else default_model_path()
    return path.stem if path.suffix == ".gguf" else path.name
