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

Implementations: worker.torch_path.TorchPath (the float32 reference and the CPU path: plain torch,
packed oneDNN linears) and worker.triton_path.TritonPath (Triton kernels; on CUDA pinned staging,
device-side sampling and decode graphs). build_execution_path() is the one place that picks one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import torch

from core.step import TokenLogprobs
from worker.attention import DECODE_GROUP_BYTES, RequestSpan
from worker.backends import ResolvedExecution
from worker.kv_cache import KVCache
from worker.model import LlamaModel
from worker.sampler import SamplingRow
from worker.structured_output import TokenBitmask


@dataclass(slots=True)
class StepBatch:
    """One step's scheduled tokens of every request, packed flat in plan order (no padding)."""

    step_id: int
    input_ids: list[int] = field(default_factory=list)  # [T]; placeholder rows filled by the runner before forward()
    positions: list[int] = field(default_factory=list)  # [T]: each token's index in its own sequence
    spans: list[RequestSpan] = field(default_factory=list)  # one per scheduled request, batch order
    sample_rows: list[int] = field(default_factory=list)  # [R]: the last row of each request that samples
    # [Q]: rows whose next token is a prompt token of a request asking for prompt logprobs (only those:
    # other requests' prompt rows never reach lm_head)
    prompt_logprob_rows: list[int] = field(default_factory=list)
    placeholder_rows: list[int] = field(default_factory=list)  # [P]: rows whose token an earlier step samples
    # per placeholder row: (step id, index among that step's sampled tokens) it reads; (-1, -1): unknown
    placeholder_sources: list[tuple[int, int]] = field(default_factory=list)

    @property
    def logit_rows(self) -> list[int]:
        """[R + Q]: the rows forward() computes logits for, sample rows first."""
        return self.sample_rows + self.prompt_logprob_rows if self.prompt_logprob_rows else self.sample_rows


@runtime_checkable
class ExecutionPath(Protocol):
    def prepare(self, batch: StepBatch) -> object:
        """Host-side work for batch (attention metadata as lists; on CUDA the staged H2D copy); returns what
        forward() takes. Plain Python, any thread. Raises ValueError if a block table cannot hold its context."""

    def forward(self, batch: StepBatch, inputs: object) -> torch.Tensor:
        """Runs the model over batch, writing its K/V into the pages; -> logits [R + Q, vocab] float32 of
        batch.logit_rows (sample rows, then prompt-logprob rows). On the compute thread, under
        torch.inference_mode()."""

    def sample(self, batch: StepBatch, logits: torch.Tensor, rows: Sequence[SamplingRow],
               token_bitmask: TokenBitmask | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
        """One token per row of logits (worker.sampler's semantics), and its logprobs where the row asks;
        constrained rows pick only among the tokens token_bitmask allows."""

    def warm_up(self) -> None:
        """What the path does once before serving, after its first forward pass (capture decode graphs)."""


def build_execution_path(model: LlamaModel, kv_cache: KVCache, block_size: int, execution: ResolvedExecution,
                         device: torch.device, decode_group_bytes: int = DECODE_GROUP_BYTES) -> ExecutionPath:
    """The one place that chooses the path, from the resolved kernel backend (worker.backends). The
    implementations are imported here, not at the top, because each imports StepBatch from this module."""
    if execution.kernel_backend == "triton":
        from worker.fused_ops import set_fused
        from worker.triton_path import TritonPath

        set_fused(model, False)  # its forward calls the model's modules as the reference defines them
        return TritonPath(model, kv_cache, block_size, execution, device)
    from worker.torch_path import TorchPath

    return TorchPath(model, kv_cache, block_size, execution, device, decode_group_bytes)
