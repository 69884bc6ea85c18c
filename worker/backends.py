"""How the worker executes a step: which kernels (torch or Triton), INT8 weights, CUDA graphs, stream overlap.

One options object, built from flags in main() (or EngineConfig) and resolved once against the
device: "auto" means Triton kernels on CUDA and plain torch on CPU. CUDA graphs and the copy-stream
overlap are CUDA-only, and graphs also need the Triton backend (the torch decode path has
data-dependent shapes), so on CPU both resolve to off and nothing CUDA-specific is ever touched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.options import WorkerOptions

DETERMINISTIC_REFUSAL = (
    "--deterministic runs on the CPU torch path only (device cpu, kernel backend torch), not on device {device} "
    "with kernel backend {backend}: the Triton kernels (and cuBLAS under the torch backend on CUDA) pick tilings and "
    "split reductions by batch size; see docs/reliability.md, 'Deterministic mode'")


@dataclass(slots=True, frozen=True)
class ResolvedExecution:
    """WorkerOptions' execution fields after looking at the device: every field is what will actually run."""

    kernel_backend: str  # "torch" or "triton"
    quantization: str
    cuda_graphs: bool
    stream_overlap: bool
    graph_batch_sizes: tuple[int, ...]
    packed_linears: bool  # worker.cpu_linear.pack_linears applies (it still skips non-float32 linears)
    cpu_int8_activations: bool  # CPU only
    cpu_fused_ops: bool  # CPU + torch backend; TorchPath still falls back to torch where the build is missing
    cpu_dense_weights: str  # one of DENSE_WEIGHT_MODES; "off" off the CPU torch path
    deterministic: bool  # batch-invariant kernels (worker.batch_invariant); CPU + torch backend only


def resolve_execution(options: WorkerOptions, device: torch.device | str) -> ResolvedExecution:
    on_cuda = torch.device(device).type == "cuda"
    backend = options.kernel_backend
    if backend == "auto":
        backend = "triton" if on_cuda else "torch"
    if options.deterministic and (on_cuda or backend != "torch"):
        raise ValueError(DETERMINISTIC_REFUSAL.format(device=torch.device(device).type, backend=backend))
    return ResolvedExecution(
        kernel_backend=backend,
        quantization=options.quantization,
        cuda_graphs=options.cuda_graphs and on_cuda and backend == "triton",
        stream_overlap=options.stream_overlap and on_cuda,
        graph_batch_sizes=options.graph_batch_sizes,
        packed_linears=options.packed_linears and not on_cuda and backend == "torch",
        cpu_int8_activations=options.cpu_int8_activations and not on_cuda,
        cpu_fused_ops=options.cpu_fused_ops and not on_cuda and backend == "torch",
        cpu_dense_weights=options.cpu_dense_weights if not on_cuda and backend == "torch" else "off",
        deterministic=options.deterministic,
    )


def graph_bucket(batch_size: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest captured batch size that holds batch_size rows; None: too big, run eagerly."""
    for bucket in buckets:
        if bucket >= batch_size:
            return bucket
    return None
