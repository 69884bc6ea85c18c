"""The execution paths: how a step runs on the hardware, one implementation per kernel backend.

Holds the ExecutionPath protocol with the options resolved against the device (base), the torch path
(torch_path: the reference and the CPU path, with its compiled-op forward in fused_ops, the
batch-invariant linears and attention plan, the OpenMP thread governor) and the Triton path (triton/:
its forward, pinned staging, decode graphs, its batch-invariant mode). build_execution_path() below is the
one place that picks.
A path builds once what its model runs on: it swaps the linears' kernels (worker.linears) and chooses
its forward; the reference model (worker.model) is never switched.

Rule: paths/ may import model/, linears/, sampling/, kernels/, native_ops and the leaf modules
(step_batch, options, memory); nothing in those imports paths/. It never imports the process files.
"""
from __future__ import annotations

import torch

from worker.model.attention import DECODE_GROUP_BYTES
from worker.model.kv_cache import KVCache
from worker.model.llama import LlamaModel
from worker.paths.base import ExecutionPath, ResolvedExecution, resolve_execution
from worker.paths.torch_path import TorchPath
from worker.paths.triton.path import TritonPath

__all__ = ["ExecutionPath", "ResolvedExecution", "build_execution_path", "resolve_execution"]


def build_execution_path(model: LlamaModel, kv_cache: KVCache, block_size: int, execution: ResolvedExecution,
                         device: torch.device, decode_group_bytes: int = DECODE_GROUP_BYTES) -> ExecutionPath:
    """The one place that chooses the path, from the resolved kernel backend (worker.paths.base.resolve_execution)."""
    if execution.kernel_backend == "triton":
        return TritonPath(model, kv_cache, block_size, execution, device)
    return TorchPath(model, kv_cache, block_size, execution, device, decode_group_bytes)
