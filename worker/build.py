"""Model + KV cache + runner from the worker's options: shared by the worker process and the in-process engine."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from plumbing.grammar import GrammarCompiler
from worker.kv_sizing import (KVCacheSizing, default_memory_fraction, measure_activation_peak, profile_batch,
                              read_sizing_record, size_from_budget, size_from_memory_or_record, write_sizing_record)
from worker.linears.ggml_blocks import block_types, block_weight_bytes, fault_in, mapped_weight_bytes
from worker.linears.ggml_repack import repack_linears
from worker.linears.group_quant import quantize_linears
from worker.linears.host_experts import HostExperts
from worker.linears.int8 import quantize_linears_int8
from worker.loader import default_model_path, load_model
from worker.draft_model import DraftModel, check_same_vocabulary
from worker.memory import free_memory_bytes
from worker.model.config import ModelConfig
from worker.model.kv_cache import bytes_per_block
from worker.model.kv_quant import kv_cache_dtype
from worker.model.moe import SparseMoE
from worker.model_runner import ModelRunner
from worker.native_ops import cpu_has_native_bf16, cpu_ops_available
from worker.options import DEVICES, DTYPE_CHOICES, WorkerOptions
from worker.parallel.ranks import Parallel
from worker.sampling.structured_output import StructuredOutput

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # DTYPE_CHOICES past auto


def resolve_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """auto: bfloat16 on CUDA and on CPUs with native bfloat16 (avx512_bf16 / AMX), float32 otherwise."""
    if name == "auto":
        native = torch.device(device).type == "cuda" or cpu_has_native_bf16()
        return torch.bfloat16 if native else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} is not one of {list(DTYPE_CHOICES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """auto: the GPU when torch sees one, else the CPU."""
    if name not in DEVICES:
        raise ValueError(f"device={name!r} is not one of {list(DEVICES)}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return torch.device(name)


def build_runner(options: WorkerOptions = WorkerOptions(), *, progress: bool = True,
                 kv_cache_bytes: int | None = None) -> ModelRunner:
    return build_sized_runner(options, progress=progress, kv_cache_bytes=kv_cache_bytes)[0]


def load_network(options: WorkerOptions, device: torch.device, dtype: torch.dtype, path: Path, progress: bool,
                 parallel: Parallel | None = None) -> tuple[nn.Module, ModelConfig]:
    """options.model on the device, its linears quantized if asked; with parallel, this rank's share of it."""
    share_of = None if parallel is None else parallel.share_of(path)  # a folder: only the rank's rows and columns read
    on_host = block_types(options.cpu_block_kernels) if cpu_ops_available() else ()
    experts_on_host = options.cpu_moe and device.type == "cuda"
    network, config = load_model(path, dtype=dtype, progress=progress, keep_quantized=options.quantization == "auto",
                                 block_types=on_host if device.type == "cpu" else (), share_of=share_of,
                                 expert_block_types=on_host if experts_on_host else None)
    if share_of is not None:
        network = parallel.wrap(network, config)
    elif parallel is not None:
        network = parallel.split(network)  # quantized weights along their groups (it names what it refuses)
    if experts_on_host:  # before the move: the experts never reach the device
        log.info("--cpu-moe: the experts of %d MoE layers stay in host memory and run on the CPU",
                 keep_experts_on_host(network))
    network = network.to(device)
    if options.cpu_block_repack and device.type == "cpu" and parallel is None and not options.deterministic:
        repack_linears(network)  # where the CPU's GEMM reads a repacked layout faster; before fault_in
    log.info("weights: %s", describe_weight_bytes(network))
    fault_in(network)  # a GGUF file's mapped blocks resident before the profile pass measures activations
    if options.quantization == "int8" and device.type == "cuda":
        quantize_linears_int8(network, use_kernel=True)  # the Triton kernel's per-channel format
    elif options.quantization in ("int8", "int4"):
        quantize_linears(network, bits=int(options.quantization.removeprefix("int")))
    return network, config


def keep_experts_on_host(model: nn.Module) -> int:
    """--cpu-moe: every MoE layer's experts behind HostExperts (worker.linears.host_experts); returns how many."""
    layers = [module for module in model.modules() if isinstance(module, SparseMoE)]
    for layer in layers:
        if not isinstance(layer.experts, HostExperts):
            layer.experts = HostExperts(layer.experts)
    return len(layers)


def build_follower(options: WorkerOptions, parallel: Parallel) -> Callable[[int, int], ModelRunner]:
    """A follower rank's share of the model, and how it builds the runners rank 0 asks for (step_mirror)."""
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    network, config = load_network(options, device, dtype, Path(options.model) if options.model else default_model_path(),
                                   False, parallel)
    return lambda num_blocks, num_host_blocks: ModelRunner(
        network, config, num_blocks=num_blocks, block_size=options.block_size, dtype=dtype, options=options,
        num_host_blocks=num_host_blocks, parallel=parallel)


def build_sized_runner(options: WorkerOptions = WorkerOptions(), *, progress: bool = True,
                       kv_cache_bytes: int | None = None, free_bytes: int | None = None,
                       parallel: Parallel | None = None) -> tuple[ModelRunner, KVCacheSizing]:
    """Loads options.model (None: the default GGUF) onto the device, quantizes its linears if asked, and
    sizes the KV cache: num_blocks, else kv_cache_bytes (None: kv_cache_mb), else kv_cache_memory_fraction
    (None: the device's default) of the memory left after the weights and a profile pass of
    max_num_batched_tokens tokens (free_bytes: that memory as given, None: measured), reusing the page count
    in kv_sizing_record when it has one for these settings (worker.kv_sizing). swap_space_gb of host memory
    become the swap tier's pages."""
    if options.group_size > 1 and parallel is None:
        raise ValueError(f"{options.split_flag()} needs the worker process (tokenmill "
                         f"serve, python -m worker.main), which starts and drives the other ranks; the in-process "
                         f"engine runs one")
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    path = Path(options.model) if options.model else default_model_path()
    network, config = load_network(options, device, dtype, path, progress, parallel)
    draft = _load_draft(options, device, dtype, config, progress, parallel)
    # a rank's pages hold its own KV heads (quantized under --kv-cache-dtype); a page id names a page of the
    # target's cache and one of the draft's (worker.draft_model, in the model dtype): both count
    per_block = bytes_per_block(config if parallel is None else parallel.kv_config(config),
                                kv_cache_dtype(options.kv_cache_dtype, dtype), options.block_size) + (
        bytes_per_block(draft[1], dtype, options.block_size) if draft else 0)
    if kv_cache_bytes is None and options.kv_cache_mb:
        kv_cache_bytes = options.kv_cache_mb * 2**20
    if options.num_blocks:
        sizing = KVCacheSizing(options.num_blocks, options.num_blocks * per_block, f"--num-blocks {options.num_blocks}")
    elif kv_cache_bytes:
        sizing = size_from_budget(kv_cache_bytes, per_block)
    else:
        sizing = _size_from_memory(network, config, path, dtype, device, options, per_block, free_bytes, parallel)
    num_host_blocks = int(options.swap_space_gb * 2**30) // per_block
    runner = ModelRunner(network, config, num_blocks=sizing.num_blocks, block_size=options.block_size, dtype=dtype,
                         options=options, num_host_blocks=num_host_blocks, parallel=parallel)
    runner.structured_output = StructuredOutput(GrammarCompiler(path))
    if draft:
        runner.drafter = DraftModel(*draft, num_blocks=sizing.num_blocks, block_size=options.block_size, dtype=dtype,
                                    options=options, num_host_blocks=num_host_blocks)
    return runner, sizing


def _load_draft(options: WorkerOptions, device: torch.device, dtype: torch.dtype, target: ModelConfig,
                progress: bool, parallel: Parallel | None) -> tuple[nn.Module, ModelConfig] | None:
    """--draft-model through the target's loader, checked against the target before any memory is sized; None
    without one."""
    if not options.draft_model:
        return None
    if parallel is not None:
        raise ValueError(f"--draft-model with --tensor-parallel-size {options.tensor_parallel_size}: not supported "
                         f"yet (the draft would run whole on rank 0, beside its share of the target)")
    draft = load_network(options, device, dtype, Path(options.draft_model), progress)
    check_same_vocabulary(target, draft[1], options.draft_model)
    return draft


def weight_bytes(network: nn.Module) -> tuple[int, int]:
    """(every weight's bytes: parameters, buffers and a GGUF file's mapped blocks, a tied tensor once; the share of
    them that is mixture-of-experts experts and routers). Every expert counts: all of them stay resident, whichever
    few a token reads, so the memory the KV cache is sized from is what is left after all of them."""
    tensors = {**dict(network.named_parameters()), **dict(network.named_buffers())}
    total = sum(t.numel() * t.element_size() for t in tensors.values()) + block_weight_bytes(network)
    experts = sum(t.numel() * t.element_size() for name, t in tensors.items()
                  if name.endswith((".mlp.experts.gate_up", ".mlp.experts.down", ".mlp.router_weight",
                                    ".mlp.experts.gate_up_bias", ".mlp.experts.down_bias", ".mlp.router_bias")))
    experts += sum(weight.nbytes for m in network.modules() for weight in getattr(m, "expert_blocks", ()))
    return total, experts


def describe_weight_bytes(network: nn.Module) -> str:
    total, experts = weight_bytes(network)
    config = getattr(network, "config", None)
    if not experts or config is None:
        return f"{total / 2**20:.1f} MiB"
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_layers))
    return (f"{total / 2**20:.1f} MiB, of which {experts / 2**20:.1f} MiB are the {config.num_experts} experts (and "
            f"router) of each of {moe_layers} MoE layers, all resident ({config.num_experts_per_tok} read per token)")


def _size_from_memory(network, config, path: Path, dtype: torch.dtype, device: torch.device, options: WorkerOptions,
                      per_block: int, free_bytes: int | None, parallel: Parallel | None) -> KVCacheSizing:
    """A share of the memory left after the weights and the profile pass's peak, or the sizing record's count."""
    fraction = options.kv_cache_memory_fraction
    if fraction is None:
        fraction = default_memory_fraction(device)
    settings = (f"model={path.resolve()} dtype={str(dtype).removeprefix('torch.')} "
                f"kv_cache_dtype={options.kv_cache_dtype} device={device} "
                f"block_size={options.block_size} fraction={fraction:g} profile_tokens={options.max_num_batched_tokens} "
                f"{options.execution_settings()}")
    peak = _activation_peak(network, config, dtype, device, options, parallel)
    record_path = options.kv_sizing_record
    record = read_sizing_record(record_path) if record_path else None
    sizing, new_record = size_from_memory_or_record(
        record, settings, (free_memory_bytes(device) if free_bytes is None else free_bytes) - mapped_weight_bytes(network),
        peak, fraction, per_block,
        device)
    if record_path and new_record:
        write_sizing_record(record_path, new_record)
    return sizing


def _activation_peak(network, config, dtype: torch.dtype, device: torch.device, options: WorkerOptions,
                     parallel: Parallel | None) -> int:
    """The profile pass's peak: a throw-away runner over just the pages the profile step needs."""
    profile = profile_batch(options.max_num_batched_tokens, options.block_size)
    probe = ModelRunner(network, config, num_blocks=len(profile.spans[0].block_table), block_size=options.block_size,
                        dtype=dtype, options=options, parallel=parallel)
    peak = measure_activation_peak(probe.execution_path, profile, device)
    del probe
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peak


def model_name(model: str | Path | None) -> str:
    path = Path(model) if model else default_model_path()
    return path.stem if path.suffix == ".gguf" else path.name
