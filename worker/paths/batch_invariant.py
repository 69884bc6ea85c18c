"""Deterministic (batch-invariant) mode: every token's sums in an order that does not depend on its step.

Greedy output differs between a request run alone, run in a batch, and recomputed after a preemption or a
worker restart, because the kernels pick their reduction order by the step's shape: oneDNN and the
group-quantized linears choose a kernel by row count (row kernels up to 8 rows, dequantized strips or a
dense copy above), and attention sums a prefill chunk's keys in SDPA's tiles but a decode token's in the
paged decode kernel. A recompute runs a request's generated tokens as a prefill, where they were decode
steps before, so the K/V written for them, and the tokens after, can differ in their last bits, and a
near-tie argmax flips.

--deterministic (WorkerOptions.deterministic) picks, once when the torch path is built:

- linears, each called with one shape whatever the step holds:
  - a group-quantized weight with a dense copy (worker.linears.dense_weights: --cpu-dense-weights, auto keeps them
    for bfloat16 on CPUs with native bfloat16) runs every row on that copy, in tiles of exactly ROW_TILE
    rows, the last padded with zeros (DenseTileLinear): one oneDNN (AMX) call shape for every step;
  - without one, the compiled row kernel, or the int8-dot kernel under --cpu-int8-activations, whatever
    the row count (RowKernelLinear: each output is one dot per activation row in K order; rows share the
    weight's loads, never a sum);
  - other weights (nn.Linear, worker.linears.packed's packed ones) in tiles of ROW_TILE rows (RowTileLinear);
- attention: every query token, prefill or decode, is a one-token span over its own context
  (token_spans): the compiled path runs them all through paged_decode_attention (one fixed order over the
  keys per query, whatever else is in the step), the plain-torch path through the decode gather + SDPA, one
  call per row (a batch of one: with several threads, SDPA and even a plain batched matmul give a row other
  last bits beside other rows of the same context length on AVX2 CPUs, so grouping rows is not enough);
- norms, activations, RoPE and sampling are per row already (compiled ops loop rows; argmax per row).

What stays the same: the numbers differ from the default mode's in their last bits (other kernels). The
Triton path has its own mode (worker.paths.triton.batch_invariant, sharing InvariantLinear, swap_linears and
token_spans from here); worker.paths.base refuses the torch backend on CUDA (cuBLAS).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from worker.linears.dense_linear import dense_linear
from worker.linears.ggml_blocks import GGMLBlocksLinear
from worker.linears.group_quant import GroupQuantLinear
from worker.model.attention import GatherWorkspace, HostAttentionPlan, span_slots
from worker.native_ops import cpu_ops_available
from worker.step_batch import RequestSpan

# rows per dense-linear call (an AMX tile's): a decode row pays for ROW_TILE - 1 rows of zeros, which at few
# rows costs little beside reading the weight (docs/reliability.md, "Deterministic mode", for the figures)
ROW_TILE = 16


class InvariantLinear(nn.Module):
    """The base of every deterministic-mode linear, on the CPU path here and on the Triton path
    (worker.paths.triton.batch_invariant): the model's own linear (inner, its buffers shared: a tied lm_head
    keeps sharing the embedding's codes) run so that a row's sums do not depend on the other rows. One
    base, so that building any path first undoes what another path's mode wrapped (swap_linears)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.inner = linear


class RowKernelLinear(InvariantLinear):
    """A GroupQuantLinear that always runs the compiled row kernel (int8-dot under int8 activations), or a
    GGMLBlocksLinear its integer-dot kernel,
    whatever the row count: a row's output is the same bits alone or beside others."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        return self.inner.forward_rows(x)


class DenseTileLinear(InvariantLinear):
    """A GroupQuantLinear with a dense copy (worker.linears.dense_weights): every row on the copy, in ROW_TILE-row
    tiles (verified bit-equal for a row at any place in a tile, beside any rows, on one or two threads)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N], x in the copy's dtype
        dense, bias = self.inner.dense_weight, self.inner.bias
        out = _in_tiles(lambda tile: dense_linear(tile, dense), x)
        return out if bias is None else out.add_(bias)


def _in_tiles(linear, x: torch.Tensor) -> torch.Tensor:
    num_rows = x.shape[0]
    padding = -num_rows % ROW_TILE
    if padding:
        x = F.pad(x, (0, 0, 0, padding))
    tiles = [linear(tile) for tile in x.split(ROW_TILE)]
    return torch.cat(tiles)[:num_rows] if len(tiles) > 1 or padding else tiles[0]


class RowTileLinear(InvariantLinear):
    """Any other linear (nn.Linear, a packed oneDNN one, a group-quantized one without the compiled ops),
    called on tiles of exactly ROW_TILE rows: the one shape its kernel ever sees."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        return _in_tiles(self.inner, x)


_LINEAR_NAMES = ("wqkv", "wo", "w_gate_up", "w_down", "lm_head")


def _invariant(linear: nn.Module) -> InvariantLinear:
    if isinstance(linear, GGMLBlocksLinear):  # its integer-dot kernel sums each row alone, in one order
        return RowKernelLinear(linear)
    if not (isinstance(linear, GroupQuantLinear) and linear.codes.device.type == "cpu" and cpu_ops_available()):
        return RowTileLinear(linear)
    if linear.dense_weight is not None and not linear.int8_activations:
        return DenseTileLinear(linear)
    return RowKernelLinear(linear)


def swap_linears(model: nn.Module, wrap: Callable[[nn.Module], InvariantLinear] | None) -> int:
    """Every linear of the model's attention, MLP and lm_head back to the model's own (whatever path's
    InvariantLinear held it), then wrapped by wrap, or left plain when wrap is None; returns how many were
    wrapped. Each path's build calls it, with or without its mode, so a model another runner built
    differently is put right."""
    wrapped = 0
    for parent in list(model.modules()):
        if isinstance(parent, InvariantLinear):
            continue
        for name in _LINEAR_NAMES:
            child = getattr(parent, name, None)
            if not isinstance(child, nn.Module):
                continue
            plain = child.inner if isinstance(child, InvariantLinear) else child
            setattr(parent, name, plain if wrap is None else wrap(plain))
            wrapped += wrap is not None
    return wrapped


def set_batch_invariant(model: nn.Module, invariant: bool) -> int:
    """The CPU path's linears: each wrapped for the mode (_invariant) or plain; returns how many were wrapped."""
    return swap_linears(model, _invariant if invariant else None)


def token_spans(spans: Sequence[RequestSpan]) -> list[RequestSpan]:
    """Each query token as a one-token span over its own context (a prefill chunk's token t attends to
    the prefix and the chunk's tokens up to t, all in the cache by then):

        chunk: rows r..r+q-1, context c   ->   row r+i: one token, context c - q + 1 + i   (i < q)
    """
    return [RequestSpan(span.query_start + i, 1, span.context_len - span.query_len + 1 + i, span.block_table)
            for span in spans for i in range(span.query_len)]


def plan_batch_invariant_attention(spans: Sequence[RequestSpan], block_size: int,
                                   workspace: GatherWorkspace | None = None, in_place: bool = False) -> HostAttentionPlan:
    """worker.model.attention.plan_attention's deterministic twin: every token a decode row (token_spans); in
    place, one group (the compiled kernel sums each row on its own); gathered, one group per row, so a row's
    SDPA call is the one shape [1, KVH, G, D] x [1, KVH, context, D] whatever else the step holds."""
    slot_mapping: list[int] = []
    for span in spans:
        slot_mapping.extend(span_slots(span, block_size)[1])
    rows = token_spans(spans)
    if in_place:
        return HostAttentionPlan(slot_mapping, [rows] if rows else [], [], in_place=True)
    return HostAttentionPlan(slot_mapping, [[row] for row in rows], [])
