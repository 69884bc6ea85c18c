"""How the worker executes a step: which kernels (torch or Triton), INT8 weights, CUDA graphs, stream overlap.

One options object, built from flags in main() (or EngineConfig) and resolved once against the
device: "auto" means Triton kernels on CUDA and plain torch on CPU. CUDA graphs and the copy-stream
overlap are CUDA-only, and graphs also need the Triton backend (the torch decode path has
data-dependent shapes), so on CPU both resolve to off and nothing CUDA-specific is ever touched.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KERNEL_BACKENDS = ("auto", "torch", "triton")
# auto: a GGUF file's weights run in the formats it holds them in (worker.group_quant), a Hugging Face
# folder's in the model dtype; none: everything dequantized to the model dtype (the reference path);
# int8 / int4: a folder's (or a file's float) linears quantized at load, group-wise (CUDA int8: per channel)
QUANTIZATIONS = ("auto", "none", "int8", "int4")
DENSE_WEIGHT_MODES = ("auto", "on", "off")  # worker.dense_weights
DENSE_WEIGHTS_HELP = ("CPU: group-quantized linears (a GGUF file's, --quantization int4/int8) also keep their weight "
                      "dequantized and reordered for oneDNN, for steps of 5 rows or more (batched decode, prefill): "
                      "one GEMM a linear (AMX where the CPU has it) for 2 bytes a weight; auto: bfloat16 models on a "
                      "CPU with native bfloat16 when the copies take at most a quarter of available memory "
                      "(default: %(default)s)")
DETERMINISTIC_REFUSAL = (
    "--deterministic runs on the CPU torch path only (device cpu, kernel backend torch), not on device {device} "
    "with kernel backend {backend}: the Triton kernels (and cuBLAS under the torch backend on CUDA) pick tilings and "
    "split reductions by batch size; see docs/reliability.md, 'Deterministic mode'")
# decode batch sizes with a captured graph; a decode step of B rows replays the smallest bucket >= B
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(slots=True, frozen=True)
class ExecutionOptions:
    kernel_backend: str = "auto"  # one of KERNEL_BACKENDS
    quantization: str = "auto"  # one of QUANTIZATIONS
    cuda_graphs: bool = True  # decode-only steps replay a graph per batch bucket (CUDA + triton only)
    stream_overlap: bool = True  # pinned staging + copy stream + event-ordered token readback (CUDA only)
    graph_batch_sizes: tuple[int, ...] = DEFAULT_GRAPH_BATCH_SIZES
    packed_linears: bool = True  # float32 linears on oneDNN-reordered weights (CPU, torch backend: worker.cpu_linear)
    # 4-bit weights x activations rounded to int8 per group of 32 for decode rows (worker.group_quant): about
    # 1.8x faster linears at one row, at the accuracy `tokenmill accuracy` prints; off keeps float activations
    cpu_int8_activations: bool = False
    # the decoder's small ops (norms, SwiGLU, RoPE + cache write, decode attention on the pages in place)
    # as compiled ops (worker.fused_ops); off: plain torch, the reference the others are tested against
    cpu_fused_ops: bool = True
    # group-quantized linears keep a dense copy of their weight for steps of many rows (worker.dense_weights):
    # auto (bfloat16 models on a CPU with native bfloat16, within a memory share), on, off
    cpu_dense_weights: str = "auto"
    # every kernel's reduction order independent of batch composition (worker.batch_invariant): greedy output
    # then survives batching, preemption and worker restarts token for token; CPU torch backend only
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend={self.kernel_backend!r} is not one of {list(KERNEL_BACKENDS)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not one of {list(QUANTIZATIONS)}")
        if self.cpu_dense_weights not in DENSE_WEIGHT_MODES:
            raise ValueError(f"cpu_dense_weights={self.cpu_dense_weights!r} is not one of {list(DENSE_WEIGHT_MODES)}")
        sizes = self.graph_batch_sizes
        if not sizes or any(size < 1 for size in sizes) or list(sizes) != sorted(set(sizes)):
            raise ValueError(f"graph_batch_sizes={sizes!r} must be distinct positive sizes in increasing order")


@dataclass(slots=True, frozen=True)
class ResolvedExecution:
    """ExecutionOptions after looking at the device: every field is what will actually run."""

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


def resolve_execution(options: ExecutionOptions, device: torch.device | str) -> ResolvedExecution:
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


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8), for the --cuda-graph-batch-sizes flag."""
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise ValueError(f"cuda graph batch sizes {text!r} must be comma-separated integers") from None
    ExecutionOptions(graph_batch_sizes=sizes)  # validates
    return sizes


def add_execution_flags(parser) -> None:
    """The worker's --device / --kernel-backend / --quantization / graph / overlap flags (argparse)."""
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when torch sees a GPU, else cpu (default: %(default)s)")
    parser.add_argument("--kernel-backend", choices=KERNEL_BACKENDS, default="auto",
                        help="auto: triton on CUDA, torch on CPU (default: %(default)s)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                        help="auto: a GGUF file's weights as it holds them (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K), a folder's "
                             "in --dtype; none: all in --dtype; int8 / int4: weight-only, quantized at load "
                             "(default: %(default)s)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly (CUDA only)")
    parser.add_argument("--cuda-graph-batch-sizes", default=",".join(map(str, DEFAULT_GRAPH_BATCH_SIZES)),
                        help="decode batch buckets with a captured graph (default: %(default)s)")
    parser.add_argument("--no-stream-overlap", action="store_true",
                        help="no pinned staging / copy stream / async token readback (CUDA only)")
    parser.add_argument("--cpu-int8-activations", action="store_true",
                        help="up to 16 rows against group-quantized weights (4-bit, Q8_0, K-quants) round their "
                             "activations to int8 per block of 32 (llama.cpp's way; faster, slightly less exact: "
                             "see tokenmill accuracy)")
    parser.add_argument("--no-packed-linears", action="store_true",
                        help="plain nn.Linear instead of weights reordered once for oneDNN (CPU, float32 only)")
    parser.add_argument("--no-cpu-fused-ops", action="store_true",
                        help="the decoder's norms, SwiGLU, RoPE and decode attention in plain torch (the reference) "
                             "instead of the compiled ops that read the KV pages in place (CPU)")
    parser.add_argument("--cpu-dense-weights", choices=DENSE_WEIGHT_MODES, default="auto",
                        help=DENSE_WEIGHTS_HELP)
    parser.add_argument("--deterministic", "--batch-invariant", action="store_true",
                        help="batch-invariant kernels: each token's linears, attention, norms and sampling reduce in "
                             "an order that does not depend on what else is in the step, so greedy output is the "
                             "same alone or batched, after preemption and after a worker restart (CPU torch path "
                             "only; slower: see docs/reliability.md)")


def execution_options_from_args(args) -> ExecutionOptions:
    return ExecutionOptions(
        kernel_backend=args.kernel_backend, quantization=args.quantization, cuda_graphs=not args.no_cuda_graphs,
        stream_overlap=not args.no_stream_overlap, graph_batch_sizes=parse_batch_sizes(args.cuda_graph_batch_sizes),
        packed_linears=not args.no_packed_linears, cpu_int8_activations=args.cpu_int8_activations,
        cpu_fused_ops=not args.no_cpu_fused_ops, cpu_dense_weights=args.cpu_dense_weights,
        deterministic=args.deterministic)
