"""A rank's share of a quantized weight, cut along its quant groups (tensor parallelism on a GGUF file's
weights, or on weights quantized at load before the split).

A quantized row is a run of groups along the input (in_features): GroupQuantWeight's codes [N, K or K/2] with
a scale and min per group of 16 or 32 values; a GGUF block row is K / E blocks of E values (32 for Q4_0..Q8_0,
256 for the K-quants) stored as bytes. So:

    column-parallel (q/k/v, gate/up, vocabulary rows): whole output rows   -> any rows; a block row is a
        view of the file's mapped pages (contiguous bytes), no copy
    row-parallel (o, down): input columns [c0, c1)  -> c0 and c1 on group / block boundaries, each row's
        bytes of those groups; a copy (the rank's share only)

A row-parallel cut inside a group would need requantizing, which would change the weights: it is refused,
naming the tensor, the columns and the group. The activations' int8 rounding of a block kernel (q8_K / q8_0,
one scale per block of x) is also per block, so a cut on block boundaries gives every rank the integer sums
the whole model makes: a split model's logits differ from the whole one's only in float summation order.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.linears.ggml_blocks import (BLOCK_BYTES, BLOCK_ELEMENTS, BlockPart, GGMLBlocksEmbedding, GGMLBlocksLinear,
                                        GGMLBlocksWeight)
from worker.linears.group_quant import GroupQuantEmbedding, GroupQuantLinear, GroupQuantWeight

QUANTIZED = (GroupQuantLinear, GGMLBlocksLinear, GroupQuantEmbedding, GGMLBlocksEmbedding)
Weight = GroupQuantWeight | GGMLBlocksWeight


def weight_of(module: nn.Module) -> Weight:
    """The quantized weight a QUANTIZED module runs on (a tied embedding and lm_head give equal ones)."""
    if isinstance(module, (GGMLBlocksLinear, GGMLBlocksEmbedding)):
        return module.weight_blocks
    return GroupQuantWeight(module.codes, module.scales, module.mins, module.bits, module.group_size, module.source)


def keep_rows(weight: Weight, ranges: list[range], rows: int | None = None) -> Weight:
    """The output rows in `ranges`, in that order, then zero rows up to `rows` (a padded vocabulary share)."""
    if isinstance(weight, GGMLBlocksWeight):
        return _block_rows(weight, ranges, rows)
    index = torch.cat([torch.arange(r.start, r.stop) for r in ranges])
    kept = weight.rows(index)
    padding = 0 if rows is None else rows - kept.out_features
    if padding <= 0:
        return kept
    zeros = GroupQuantWeight(kept.codes.new_zeros(padding, kept.codes.shape[1]), kept.scales.new_zeros(padding, kept.scales.shape[1]),
                             kept.mins.new_zeros(padding, kept.mins.shape[1]), kept.bits, kept.group_size, kept.source)
    return GroupQuantWeight.concat_rows([kept, zeros])


def _block_rows(weight: GGMLBlocksWeight, ranges: list[range], rows: int | None) -> GGMLBlocksWeight:
    parts: list[BlockPart] = []
    for wanted in ranges:
        offset = 0
        for part in weight.parts:  # a fused weight's parts follow each other: q, k, v, each its own type
            low, high = max(wanted.start, offset), min(wanted.stop, offset + part.rows)
            if low < high:
                parts.append(BlockPart(part.type_name, part.blocks[low - offset : high - offset]))
            offset += part.rows
    padding = 0 if rows is None else rows - sum(part.rows for part in parts)
    if padding > 0:  # zero bytes are zero scales: rows of zeros in every block type
        last = parts[-1]
        parts.append(BlockPart(last.type_name, last.blocks.new_zeros(padding, last.blocks.shape[1])))
    return GGMLBlocksWeight(tuple(parts), weight.in_features)


def keep_columns(weight: Weight, columns: slice, name: str) -> Weight:
    """The input columns [columns.start, columns.stop) of every row; raises ValueError naming `name` when a
    bound falls inside a quant group or block."""
    if isinstance(weight, GGMLBlocksWeight):
        parts = []
        for part in weight.parts:
            elements, size = BLOCK_ELEMENTS[part.type_name], BLOCK_BYTES[part.type_name]
            _check_boundary(name, columns, elements, f"{part.type_name} block")
            cut = part.blocks[:, columns.start // elements * size : columns.stop // elements * size]
            parts.append(BlockPart(part.type_name, cut.contiguous()))
        return GGMLBlocksWeight(tuple(parts), columns.stop - columns.start)
    _check_boundary(name, columns, weight.group_size, f"{weight.bits}-bit quantization group")
    per_value = 2 if weight.bits == 4 else 1  # 4-bit codes: a group of 32 is 16 bytes of the row
    groups = slice(columns.start // weight.group_size, columns.stop // weight.group_size)
    codes = weight.codes[:, columns.start // per_value : columns.stop // per_value]
    return GroupQuantWeight(codes.contiguous(), weight.scales[:, groups].contiguous(), weight.mins[:, groups].contiguous(),
                            weight.bits, weight.group_size, weight.source)


def _check_boundary(name: str, columns: slice, group: int, what: str) -> None:
    if columns.start % group or columns.stop % group:
        raise ValueError(f"tensor parallelism cuts {name}'s input columns at [{columns.start}, {columns.stop}), inside "
                         f"a {group}-value {what}: use a size whose share is a whole number of groups, or "
                         f"--quantization none")


def linear_on(weight: Weight, bias: torch.Tensor | None) -> nn.Module:
    """The module that runs `weight` as a linear layer (the rank's share of a quantized one)."""
    if isinstance(weight, GGMLBlocksWeight):
        return GGMLBlocksLinear(weight, bias)
    return GroupQuantLinear(weight, bias)


def embedding_on(weight: Weight, dtype: torch.dtype) -> nn.Module:
    if isinstance(weight, GGMLBlocksWeight):
        return GGMLBlocksEmbedding(weight, dtype)
    return GroupQuantEmbedding(weight, dtype)
