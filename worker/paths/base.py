"""The seam between the ModelRunner and the hardware: one protocol, one implementation per kernel path.

The runner owns everything that is the same on every device: the requests' tokens and block tables,
packing a plan into one flat StepBatch (invariant 5), placeholder rows under async scheduling, the
result. An ExecutionPath owns what differs: how a batch's inputs reach the device, which forward pass
runs, and how tokens are drawn. A step goes through it in this order:

    inputs = path.prepare(batch)         any thread, plain Python (see below); may start an H2D copy
    logits = path.forward(batch, inputs)  compute thread, after the previous step's sample()
    ids, logprobs = path.sample(batch, logits, rows)

and once before serving, after one forward pass: path.warm_up().

prepare() runs on the worker's RPC thread while the step before still computes, so it makes no torch
CPU op (that would start a second OpenMP team) and reads nothing that step has not produced yet: the
batch's placeholder rows hold PLACEHOLDER_TOKEN_ID until the runner fills them, just before forward().

Implementations: worker.paths.torch_path.TorchPath (the float32 reference and the CPU path: plain torch,
packed oneDNN linears) and worker.paths.triton.path.TritonPath (Triton kernels; on CUDA pinned staging,
device-side sampling and decode graphs). build_execution_path() is the one place that picks one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch

from core.step import TokenLogprobs
from worker.model.config import ModelConfig
from worker.options import WorkerOptions
from worker.sampling.sampler import SamplingRow
from worker.sampling.structured_output import TokenBitmask
from worker.step_batch import StepBatch


class StepInputs(Protocol):
    """What a path's prepare() returns and its own forward() takes (TorchPath: the attention plan as host
    lists; TritonPath: the staged metadata). The runner only carries it from one to the other."""


@runtime_checkable
class ExecutionPath(Protocol):
    def prepare(self, batch: StepBatch) -> StepInputs:
        """Host-side work for batch (attention metadata as lists; on CUDA the staged H2D copy); returns what
        forward() takes. Plain Python, any thread. Raises ValueError if a block table cannot hold its context."""

    def forward(self, batch: StepBatch, inputs: StepInputs) -> torch.Tensor:
        """Runs the model over batch, writing its K/V into the pages; -> logits [R + Q, vocab] float32 of
        batch.logit_rows (sample rows, then prompt-logprob rows). On the compute thread, under
        torch.inference_mode()."""

    def sample(self, batch: StepBatch, logits: torch.Tensor, rows: Sequence[SamplingRow],
               token_bitmask: TokenBitmask | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row of logits (worker.sampling.sampler's semantics), and its logprobs where the row asks;
        constrained rows pick only among the tokens token_bitmask allows."""

    def warm_up(self) -> None:
        """What the path does once before serving, after its first forward pass (capture decode graphs)."""


DETERMINISTIC_REFUSAL = (
    "--deterministic on CUDA runs on the Triton kernel backend (--kernel-backend triton or auto), not on kernel "
    "backend torch: its linears are cuBLAS calls, which pick their algorithm, tiles and split-K by shape, so a row's "
    "sums change with the batch; see docs/reliability.md, 'Deterministic mode'")


VARIABLE_EXPERT_ROWS = ("each expert's matmuls run over however many of the step's tokens chose it, a row count that "
                        "changes with the batch; run without --deterministic")


FP8_CAPABILITY = (8, 9)  # Ada / Hopper: the first GPUs whose Triton converts to and from float8 e4m3


def check_kv_cache_dtype(kv_cache_dtype: str, backend: str, device: torch.device | str) -> None:
    """Refuses at start what cannot run: float8 pages on the Triton path of a GPU older than FP8_CAPABILITY
    (its kernels write and read them with float8 conversions the compiler has no instruction for there)."""
    device = torch.device(device)
    if kv_cache_dtype != "fp8_e4m3" or backend != "triton" or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise ValueError(
            f"--kv-cache-dtype fp8_e4m3 on --kernel-backend triton needs a GPU of compute capability "
            f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer (float8 conversions), this one is "
            f"{capability[0]}.{capability[1]}; use --kv-cache-dtype int8 (same bytes), or --kernel-backend torch")


def moe_refusal(architecture: str, what: str, why: str) -> str:
    """The start-time error of a path that cannot run a mixture of experts, naming the path and the architecture."""
    return f"{what} cannot run the mixture-of-experts architecture {architecture!r}: {why}"


@dataclass(slots=True, frozen=True)
class ResolvedExecution:
    """WorkerOptions' execution fields after looking at the device: every field is what will actually run."""

    kernel_backend: str  # "torch" or "triton"
    quantization: str
    cuda_graphs: bool
    stream_overlap: bool
    graph_batch_sizes: tuple[int, ...]
    packed_linears: bool  # worker.linears.packed.pack_linears applies (it still skips non-float32 linears)
    cpu_int8_activations: bool  # CPU only
    cpu_fused_ops: bool  # CPU + torch backend; TorchPath still falls back to torch where the build is missing
    cpu_dense_weights: str  # one of DENSE_WEIGHT_MODES; "off" off the CPU torch path
    deterministic: bool  # batch-invariant kernels (worker.paths.batch_invariant, worker.paths.triton.batch_invariant)


def _kernel_backend(options: WorkerOptions, on_cuda: bool, model_config: ModelConfig | None) -> str:
    """auto: Triton on CUDA (a mixture of experts too: worker.kernels.fused_moe), torch on CPU."""
    moe = model_config is not None and model_config.num_experts > 0
    backend = options.kernel_backend
    if backend == "auto":
        backend = "triton" if on_cuda else "torch"
    if options.group_size > 1:
        if options.deterministic:
            raise ValueError(f"--deterministic with {options.split_flag()}: a split model's reductions are not made "
                             f"batch-invariant yet")
        if options.pipeline_parallel_size > 1:  # a stage's forward is its own (worker.parallel.pipeline)
            if options.kernel_backend == "triton":
                raise ValueError(f"{options.split_flag()} runs on --kernel-backend torch (or auto): a pipeline "
                                 f"stage's forward is the torch modules'")
            backend = "torch"
    if moe and options.deterministic:
        raise ValueError(moe_refusal(model_config.architecture, "--deterministic (the batch-invariant kernels)",
                                     VARIABLE_EXPERT_ROWS))
    return backend


def resolve_execution(options: WorkerOptions, device: torch.device | str,
                      model_config: ModelConfig | None = None) -> ResolvedExecution:
    """model_config (when known): a mixture of experts is refused by what cannot run it (--deterministic)."""
    on_cuda = torch.device(device).type == "cuda"
    backend = _kernel_backend(options, on_cuda, model_config)
    if options.deterministic and on_cuda and backend == "torch":
        raise ValueError(DETERMINISTIC_REFUSAL)
    check_kv_cache_dtype(options.kv_cache_dtype, backend, device)
    return ResolvedExecution(
        kernel_backend=backend,
        quantization=options.quantization,
        # off under --deterministic until a device shows a replay equal to the eager step, bit for bit
        # (tests/gpu/test_cuda_deterministic.py checks it; worker.paths.triton.batch_invariant)
        # and off under a tensor split until a device shows NCCL's all-reduces captured in a graph replaying right
        # and with --cpu-moe, whose layers compute on the host between the device's kernels
        cuda_graphs=(options.cuda_graphs and on_cuda and backend == "triton" and not options.deterministic
                     and options.group_size == 1 and not options.cpu_moe),
        stream_overlap=options.stream_overlap and on_cuda,
        graph_batch_sizes=options.graph_batch_sizes,
        packed_linears=options.packed_linears and not on_cuda and backend == "torch",
        cpu_int8_activations=options.cpu_int8_activations and not on_cuda,
        # the compiled ops read each layer's weights themselves, and a rank's share wraps them (worker.parallel)
        cpu_fused_ops=options.cpu_fused_ops and not on_cuda and backend == "torch" and options.group_size == 1,
        cpu_dense_weights=options.cpu_dense_weights if not on_cuda and backend == "torch" else "off",
        deterministic=options.deterministic,
    )
