"""The worker's options, declared once (STYLE habit 16): every flag of `python -m worker.main`, torch-free.

`tokenmill serve` offers the fields marked cluster=True under the same names (WorkerOptions.add_arguments
with cluster=True) and imports the choices tuples below instead of keeping copies; the fields marked
cluster=False it sets for each child itself (addresses, the sizing record, values several services share).

The execution fields (kernel_backend ... deterministic) say how a step runs. They are resolved once against
the device by worker.paths.resolve_execution: "auto" means Triton kernels on CUDA and plain torch on CPU.
CUDA graphs and the copy-stream overlap are CUDA-only, and graphs also need the Triton backend (the torch
decode path has data-dependent shapes), so on CPU both resolve to off and nothing CUDA-specific is touched.

The last fields are not flags of their own: the TLS settings, the admitted peer roles, the internal secret,
the message-size limit, the metrics port and the two internal-server switches come from plumbing's shared
flags (plumbing.tls, peer_roles, internal_secret, message_size, telemetry), which worker.main adds to its
parser and passes to from_args as overrides.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from plumbing.message_size import INTERNAL_MAX_MESSAGE_BYTES
from plumbing.options import (NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, PORT, POSITIVE, POSITIVE_FLOAT, POWER_OF_TWO,
                              PROBABILITY, Options, option)

if TYPE_CHECKING:
    from plumbing.tls import ServerTLS

DEVICES = ("auto", "cpu", "cuda")
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")  # worker.build.DTYPES maps the last three
# auto: the KV pages in the model dtype; int8 / fp8_e4m3: 1-byte values with a scale per token and KV head
# (worker.model.kv_quant), about half the bytes of bfloat16 pages
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
KERNEL_BACKENDS = ("auto", "torch", "triton")
# auto: a GGUF file's weights run in the formats it holds them in (worker.linears.group_quant), a Hugging Face
# folder's in the model dtype; none: everything dequantized to the model dtype (the reference path);
# int8 / int4: a folder's (or a file's float) linears quantized at load, group-wise (CUDA int8: per channel)
QUANTIZATIONS = ("auto", "none", "int8", "int4")
DENSE_WEIGHT_MODES = ("auto", "on", "off")  # worker.linears.dense_weights
CPU_BLOCK_KERNEL_MODES = ("auto", "all", "off")  # worker.linears.ggml_blocks.block_types
# decode batch sizes with a captured graph; a decode step of B rows replays the smallest bucket >= B
DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# the fields that say how a step runs (what worker.paths.ResolvedExecution resolves)
EXECUTION_FIELDS = ("kernel_backend", "quantization", "cuda_graphs", "stream_overlap", "graph_batch_sizes",
                    "packed_linears", "cpu_int8_activations", "cpu_fused_ops", "cpu_dense_weights", "deterministic",
                    "cpu_block_kernels", "cpu_block_repack", "cpu_moe")


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8), for the --cuda-graph-batch-sizes flag."""
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise ValueError(f"cuda graph batch sizes {text!r} must be comma-separated integers") from None
    check_batch_sizes(sizes)
    return sizes


def _batch_sizes_argument(text: str) -> tuple[int, ...]:
    try:
        return parse_batch_sizes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def check_batch_sizes(sizes: tuple[int, ...]) -> None:
    if not sizes or any(size < 1 for size in sizes) or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"graph_batch_sizes={sizes!r} must be distinct positive sizes in increasing order")


def _flat_sizes(sizes) -> tuple[int, ...]:
    """The flag gives one tuple per argument ('1,2,8' or '1 2 8'): one sorted tuple of them all."""
    if all(isinstance(size, int) for size in sizes):
        return tuple(sizes)
    return tuple(sorted({size for part in sizes for size in (part if isinstance(part, tuple) else (part,))}))


@dataclass(frozen=True, slots=True)
class WorkerOptions(Options):
    GROUP = "worker"

    host: str = option("127.0.0.1", "address the worker listens on", cluster=False)
    port: int = option(50053, "port the worker listens on", type=PORT, cluster=False)
    model: str | None = option(None, "GGUF file or HF folder (default: SmolLM2-135M-Instruct)", cluster=False)
    # --speculative draft (issue 35; worker.draft_model): loaded beside the target by the same loader
    draft_model: str | None = option(None, "GGUF file or HF folder of a draft model with the target's tokenizer, for "
                                     "the scheduler's --speculative draft (its KV cache shares the target's pages)")
    dtype: str = option("auto", "auto: bfloat16 on CUDA and on CPUs with avx512_bf16/AMX, else float32 "
                        "(default: %(default)s)", choices=DTYPE_CHOICES)
    block_size: int = option(16, "tokens per KV page (a power of two)", type=POWER_OF_TWO, cluster=False)
    kv_cache_mb: int | None = option(None, "memory budget for the KV cache; overrides --kv-cache-memory-fraction",
                                     type=POSITIVE)
    kv_cache_dtype: str = option(
        "auto", "auto: KV pages in the model dtype; int8 / fp8_e4m3: one byte a value plus a float16 scale per token "
        "and KV head, about 1.9x the tokens per GB of bfloat16 pages (accuracy: "
        "docs/models.md) (default: %(default)s)", choices=KV_CACHE_DTYPES)
    kv_cache_memory_fraction: float | None = option(
        None, "share of the memory free after the weights and the profile pass's activation peak that the KV "
        "cache takes (default: 0.9 on CUDA, 0.1 of available RAM on CPU)", type=PROBABILITY)
    max_num_batched_tokens: int = option(512, "the largest step the scheduler plans: the profile pass runs one "
                                         "that size", type=POSITIVE, cluster=False)
    swap_space_gb: float = option(0.0, "host memory for swapped-out KV pages (pinned on CUDA); 0: preemption only "
                                  "recomputes", type=NON_NEGATIVE_FLOAT)
    num_blocks: int | None = option(None, "KV pages; overrides --kv-cache-mb", type=POSITIVE)
    kv_sizing_record: Path | None = option(
        None, "JSON file where the first start records the KV cache size it chose from memory; a restart with the "
        "same settings reuses it, so the scheduler meets the page count it was built for. Put it where it "
        "outlives the process, not the deployment (tokenmill serve: the worker's temp dir; Kubernetes: an "
        "emptyDir). Default: none, each start sizes anew", type=Path, cluster=False)
    threads: int | None = option(None, "torch CPU threads (default: all cores)", type=int)
    device: str = option("auto", "auto: cuda when torch sees a GPU, else cpu (default: %(default)s)", choices=DEVICES)
    # -- execution: how a step runs (resolved against the device by worker.paths.resolve_execution) --
    kernel_backend: str = option("auto", "auto: triton on CUDA, torch on CPU (default: %(default)s)",
                                 choices=KERNEL_BACKENDS)
    quantization: str = option(
        "auto", "auto: a GGUF file's weights as it holds them (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K), a folder's "
        "in --dtype; none: all in --dtype; int8 / int4: weight-only, quantized at load (default: %(default)s)",
        choices=QUANTIZATIONS)
    # decode-only steps replay a graph per batch bucket (CUDA + triton only)
    cuda_graphs: bool = option(True, "run decode steps eagerly (CUDA only)")
    graph_batch_sizes: tuple[int, ...] = option(
        DEFAULT_GRAPH_BATCH_SIZES, "decode batch buckets with a captured graph, e.g. 1,2,4,8",
        flag="--cuda-graph-batch-sizes", type=_batch_sizes_argument)
    # pinned staging + copy stream + event-ordered token readback (CUDA only)
    stream_overlap: bool = option(True, "no pinned staging / copy stream / async token readback (CUDA only)")
    # 4-bit weights x activations rounded to int8 per group of 32 for decode rows (worker.linears.group_quant):
    # about 1.8x faster linears at one row, at the accuracy `tokenmill accuracy` prints
    cpu_int8_activations: bool = option(
        False, "up to 16 rows against group-quantized weights (4-bit, Q8_0, K-quants) round their activations to "
        "int8 per block of 32 (llama.cpp's way; faster, slightly less exact: see tokenmill accuracy)")
    # a GGUF file's tensors on its own mapped blocks with int8 activations (worker.linears.ggml_blocks); the
    # others through the group_quant conversion (float activations, ~1.5x the memory for K-quants)
    cpu_block_kernels: str = option(
        "auto", "CPU: which GGUF tensors run on the file's own mapped blocks with activations rounded to int8 per "
        "256 values (llama.cpp's q8_K) instead of the group-quantized conversion (float activations, about 1.5x the "
        "file's memory): auto: the K-quants and IQ4s (Q2_K-Q6_K, IQ4_NL, IQ4_XS); all: also Q4_0, Q4_1, Q5_0, Q5_1, "
        "Q8_0; off: none "
        "(default: %(default)s)", choices=CPU_BLOCK_KERNEL_MODES)
    # K-quant block linears repacked at load where auto runs them on the AVX2 GEMM (worker.linears.ggml_repack)
    cpu_block_repack: bool = option(
        True, "CPU: keep the K-quant block linears (and a mixture of experts' expert blocks) in the file's own layout "
        "instead of repacking them once at load "
        "(where the kernels run an AVX2 GEMM: AVX2 without AVX-512 VNNI) into the 8-row groups it reads fastest "
        "(about the file's size; the file's pages are given back)")
    # float32 linears on oneDNN-reordered weights (CPU, torch backend: worker.linears.packed)
    packed_linears: bool = option(True, "plain nn.Linear instead of weights reordered once for oneDNN (CPU, float32 "
                                  "only)")
    # the decoder's small ops as compiled ops (worker.paths.fused_ops); off: plain torch, the reference
    cpu_fused_ops: bool = option(
        True, "the decoder's norms, SwiGLU, RoPE and decode attention in plain torch (the reference) instead of the "
        "compiled ops that read the KV pages in place (CPU)")
    cpu_dense_weights: str = option(
        "auto", "CPU: group-quantized linears (a GGUF file's, --quantization int4/int8) also keep their weight "
        "dequantized and reordered for oneDNN, for steps of 5 rows or more (batched decode, prefill): one GEMM a "
        "linear (AMX where the CPU has it) for 2 bytes a weight; auto: bfloat16 models on a CPU with native "
        "bfloat16 when the copies take at most a quarter of available memory (default: %(default)s)",
        choices=DENSE_WEIGHT_MODES)
    # llama.cpp's --cpu-moe: a MoE too large for the device runs its experts where the host's memory holds them
    # (worker.linears.host_experts)
    cpu_moe: bool = option(
        False, "CUDA: a mixture of experts' expert weights stay in host memory (a GGUF file's in its own blocks, as "
        "--cpu-block-kernels picks) and run on the CPU, attention and dense weights on the GPU (llama.cpp's "
        "--cpu-moe: a 30B-A3B model on one consumer GPU); decode steps then run without CUDA graphs")
    # every kernel's reduction order independent of batch composition (worker.paths.batch_invariant and
    # worker.paths.triton.batch_invariant)
    deterministic: bool = option(
        False, "batch-invariant kernels: each token's linears, attention, norms and sampling reduce in an order "
        "that does not depend on what else is in the step, so greedy output is the same alone or batched, after "
        "preemption and after a worker restart (CPU torch path, and the Triton backend, where CUDA graphs are then "
        "off; not the torch backend on CUDA; slower: see docs/reliability.md)",
        flag=("--deterministic", "--batch-invariant"))
    # glibc keeps a step's large freed tensors for the next step instead of unmapping them (worker.host_heap)
    keep_freed_memory: bool = option(
        True, "let the C heap give each freed block over 32 MiB back to the system (glibc's default): every step "
        "then faults the pages of its large tensors in again, e.g. a 256-row decode step's logits (default: kept, "
        "the largest step's working set stays in the process, as with tcmalloc)")
    # -- one model over several ranks (worker.parallel), rank 0 serving the scheduler and driving the others --
    tensor_parallel_size: int = option(
        1, "ranks one model is split over by heads, MLP columns and vocabulary, one all-reduce per attention and MLP "
        "(torch.distributed: gloo on CPU, NCCL on CUDA) (default: %(default)s)", type=POSITIVE)
    pipeline_parallel_size: int = option(
        1, "ranks one model is split over by layers, each stage's hidden states sent to the next: for nodes without "
        "a fast interconnect; not with --tensor-parallel-size yet (default: %(default)s)", type=POSITIVE)
    rank: int = option(
        0, "this process's rank in its worker group; 0 serves gRPC, the others follow it (set per process: by rank "
        "0 itself on one machine, by the deployment across several)", type=NON_NEGATIVE_INT, cluster=False)
    rendezvous: str | None = option(
        None, "rank 0's rendezvous, tcp://HOST:PORT, the same on every rank; unset on rank 0: it picks a free local "
        "port and starts ranks 1..N-1 itself as its child processes (one machine)", cluster=False)
    collective_timeout_s: float = option(
        60.0, "how long a rank waits in a step's collective (all-reduce, all-gather) for the others before it gives "
        "up and the group restarts: a rank that hangs or died (default: %(default)s)", type=POSITIVE_FLOAT)
    # -- from plumbing's shared flags (worker.main passes them to from_args) --
    tls: ServerTLS | None = field(default=None)  # None: plaintext
    allowed_roles: frozenset[str] = field(default=frozenset({"scheduler"}))  # mTLS: the peer roles admitted
    internal_secret: str | None = field(default=None, repr=False)  # callers other than health checks send it
    max_message_bytes: int = field(default=INTERNAL_MAX_MESSAGE_BYTES)
    metrics_port: int | None = field(default=None)
    insecure_internal: bool = field(default=False)
    no_reflection: bool = field(default=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "graph_batch_sizes", _flat_sizes(self.graph_batch_sizes))
        for name, value, allowed in (("dtype", self.dtype, DTYPE_CHOICES), ("device", self.device, DEVICES),
                                     ("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES),
                                     ("kernel_backend", self.kernel_backend, KERNEL_BACKENDS),
                                     ("quantization", self.quantization, QUANTIZATIONS),
                                     ("cpu_dense_weights", self.cpu_dense_weights, DENSE_WEIGHT_MODES),
                                     ("cpu_block_kernels", self.cpu_block_kernels, CPU_BLOCK_KERNEL_MODES)):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {list(allowed)}")
        check_batch_sizes(self.graph_batch_sizes)
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} with pipeline_parallel_size="
                             f"{self.pipeline_parallel_size}: one kind of split at a time for now")
        if self.rank >= self.group_size:
            raise ValueError(f"rank={self.rank} is outside a worker group of {self.group_size} ranks "
                             f"(0..{self.group_size - 1})")
        if self.rank > 0 and not self.rendezvous:
            raise ValueError(f"rank={self.rank} needs --rendezvous, rank 0's tcp://HOST:PORT")

    @property
    def group_size(self) -> int:
        """The ranks of this worker's group: one model over tensor x pipeline ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def split_flag(self) -> str:
        """The flag that splits this worker's model, for messages: '--pipeline-parallel-size 2'."""
        if self.pipeline_parallel_size > 1:
            return f"--pipeline-parallel-size {self.pipeline_parallel_size}"
        return f"--tensor-parallel-size {self.tensor_parallel_size}"

    def execution_settings(self) -> str:
        """The execution fields as text (a KV sizing record is reused only under the same ones)."""
        return " ".join(f"{name}={getattr(self, name)!r}" for name in EXECUTION_FIELDS)
