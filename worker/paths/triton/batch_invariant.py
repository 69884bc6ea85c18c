"""Deterministic (batch-invariant) mode on the Triton path: every token's sums in an order its step does not change.

The CPU path's mode (worker.paths.batch_invariant) explains why greedy output otherwise depends on the batch.
On the Triton path the shape-dependent choices were: cuBLAS under the float linears (algorithm, tiles and
split-K by shape), the int8 and group-quantized kernels' tile sizes by row count (and the group-quantized
GEMV kernel up to 8 rows, the tiled one above), the decode kernel's split count (from the batch size and
the block-table width: worker.kernels.paged_decode_attention.default_num_splits), and a prefill chunk's
attention in the prefill kernel where the same token, recomputed, had been a decode row. What the mode
picks, once, when TritonPath is built:

- linears (set_fixed_tile_linears): float and int8 weights through worker.kernels.fixed_tile_matmul (one
  tile configuration for every row count, no split-K); group-quantized weights through group_quant_matmul's
  dequantizing kernel with one configuration (GROUP_QUANT_TILE) for every row count;
- attention (token_host_metadata + batch_invariant_kernels): every query token, prefill or decode, is a
  one-token row over its own context (worker.paths.batch_invariant.token_spans), all through the decode
  kernel with one split: one program per (token, KV head) sums its keys from the first in BLOCK_N-key
  steps, the same program a decode step runs for that token;
- RMSNorm (the q/k norms too), rotary, SiLU·mul, KV write: one program per row or per element already;
  sampling: argmax, the sampling kernel (per-row thresholds, per-row seeds) or worker.sampling.sampler,
  all per row. Nothing to change.

CUDA graphs stay off in the mode (worker.paths.base.resolve_execution): a replay should equal the eager
step, since padding rows share no sum with real ones, but no device has shown it yet.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Callable, Sequence

import torch
from torch import nn

from worker.linears.group_quant import GroupQuantLinear
from worker.linears.int8 import Int8Linear
from worker.paths.batch_invariant import InvariantLinear, swap_linears, token_spans
from worker.paths.triton.forward import HostMetadata, TritonKernels, host_metadata
from worker.step_batch import RequestSpan

# group_quant_matmul's dequantizing kernel: (BLOCK_M, BLOCK_N, BLOCK_GROUPS, num_warps) for every row count;
# like fixed_tile_matmul's FIXED_TILE, a first guess that no device has timed
GROUP_QUANT_TILE = (32, 64, 4, 4)


class FixedTileLinear(InvariantLinear):
    """An nn.Linear (float weight) through fixed_tile_matmul."""

    def __init__(self, linear: nn.Linear, matmul: Callable[..., torch.Tensor]) -> None:
        super().__init__(linear)
        self.matmul = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        out = self.matmul(x.reshape(-1, x.shape[-1]), self.inner.weight, self.inner.bias)
        return out.view(*x.shape[:-1], out.shape[-1])


class FixedTileInt8Linear(InvariantLinear):
    """An Int8Linear (int8 weight, a scale per output channel) through fixed_tile_matmul."""

    def __init__(self, linear: Int8Linear, matmul: Callable[..., torch.Tensor]) -> None:
        super().__init__(linear)
        self.matmul = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        inner = self.inner
        out = self.matmul(x.reshape(-1, x.shape[-1]), inner.weight_q, inner.bias, scales=inner.scales)
        return out.view(*x.shape[:-1], out.shape[-1])


class FixedTileGroupQuantLinear(InvariantLinear):
    """A GroupQuantLinear through group_quant_matmul's dequantizing kernel in GROUP_QUANT_TILE (each weight
    rounded once to the activations' dtype before its dot: exact for float32, one rounding for bfloat16)."""

    def __init__(self, linear: GroupQuantLinear, matmul: Callable[..., torch.Tensor]) -> None:
        super().__init__(linear)
        self.matmul = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N]
        inner = self.inner
        out = self.matmul(x.reshape(-1, inner.in_features), inner.codes, inner.scales, inner.mins, inner.bits,
                          inner.group_size, inner.bias, kernel="dequant", dequant_config=GROUP_QUANT_TILE)
        return out.view(*x.shape[:-1], inner.out_features)


def _fixed_tile(linear: nn.Module) -> InvariantLinear:
    # the kernel modules are imported here, when a path is built: TRITON_INTERPRET must be set before that
    from worker.kernels.fixed_tile_matmul import fixed_tile_matmul
    from worker.kernels.group_quant_matmul import group_quant_matmul

    if isinstance(linear, GroupQuantLinear):
        return FixedTileGroupQuantLinear(linear, group_quant_matmul)
    if isinstance(linear, Int8Linear):
        return FixedTileInt8Linear(linear, fixed_tile_matmul)
    if type(linear) is nn.Linear:
        return FixedTileLinear(linear, fixed_tile_matmul)
    raise ValueError(f"--deterministic on the Triton path has no fixed-tile kernel for a {type(linear).__name__} "
                     "(float nn.Linear, Int8Linear and GroupQuantLinear weights have one)")


def set_fixed_tile_linears(model: nn.Module, invariant: bool) -> int:
    """The Triton path's linears: each through its fixed-tile kernel (invariant) or plain (the model's own
    kernels, also undoing another path's mode); returns how many were wrapped."""
    return swap_linears(model, _fixed_tile if invariant else None)


def token_host_metadata(spans: Sequence[RequestSpan], block_size: int) -> HostMetadata:
    """host_metadata of every query token as its own one-token row (token_spans): a decode-only step of T
    rows, whose slot mapping is the packed batch's own.

        spans   a: rows 0..2, context 7     b: row 3, context 9
        rows    0: ctx 5   1: ctx 6   2: ctx 7   3: ctx 9        (each with its request's block table)
    """
    return host_metadata(token_spans(spans), block_size)


def _no_prefill_attention(*args, **kwargs) -> torch.Tensor:
    raise AssertionError("deterministic mode: token_host_metadata makes every step decode-only, so the prefill "
                         "kernel never runs")


def batch_invariant_kernels(kernels: TritonKernels) -> TritonKernels:
    """The forward's kernels with attention pinned: the decode kernel in one split for every batch (the
    split count otherwise follows the batch size), and no prefill kernel (every token is a decode row)."""
    return replace(kernels, paged_decode_attention=partial(kernels.paged_decode_attention, num_splits=1),
                   paged_prefill_attention=_no_prefill_attention)
