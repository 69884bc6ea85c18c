"""A mixture of experts' experts on a GGUF file's own stacked blocks (`ffn_{gate,up,down}_exps`, issue 36): the
file's mapped pages, no conversion and no copy, run by the dense block linears' int8-activation kernels
(worker/csrc/ggml_blocks_experts.cpp schedules ggml_blocks_dot.cpp's and ggml_blocks_amx.cpp's row kernels).

The float experts (worker.model.moe.StackedExperts) are the reference: the same seam, rows sorted by expert and
their counts in, each pair's output out. Here forward() is two native calls, gate/up (both stacked halves at
once) and down, each running every expert that has rows with threads spread over (expert, 64 weight rows) items;
the activation between them is torch's. A model's MoE layer calls routed() instead: the grouping by expert, both
calls, the activation and the weighted sum onto the tokens in one native call, to the same bits (run_grouped's
~15 torch calls a layer around the experts took a one-token step longer than that token's expert arithmetic).
Accuracy is the dense block linears': x rounded to int8 per 256 values.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from worker.linears.ggml_blocks import (BLOCK_BYTES, BLOCK_ELEMENTS, KERNEL_PATHS, BlockPart,
                                        CpuOnlyBlocks, PartsOfBlocks, mapped_bytes_tensor)
from worker.native_ops import cpu_ops_available


@dataclass(frozen=True, slots=True)
class ExpertBlocksWeight(PartsOfBlocks):
    """One projection of every expert as the file stacks it: parts of blocks uint8 [E, rows_i, row bytes], each
    in its own GGML type. Expert e's output rows are its rows of each part in turn (gate's, then up's)."""
    parts: tuple[BlockPart, ...]
    in_features: int

    def __post_init__(self) -> None:
        self._check_parts("expert ", ("experts", "rows"))
        experts = {part.blocks.shape[0] for part in self.parts}
        if len(experts) != 1:
            raise ValueError(f"stacked expert parts disagree on the number of experts: {sorted(experts)}")

    @staticmethod
    def from_blocks(parts: list[tuple[str, np.ndarray | torch.Tensor]], num_experts: int, in_features: int
                    ) -> ExpertBlocksWeight:
        """parts: (GGML type, the file's blocks of [E, rows, in_features] values, any shape) -> the stacked weight."""
        def blocks_of(type_name: str, blocks: np.ndarray | torch.Tensor) -> torch.Tensor:
            tensor = blocks if isinstance(blocks, torch.Tensor) else mapped_bytes_tensor(blocks)
            row_bytes = in_features // BLOCK_ELEMENTS[type_name] * BLOCK_BYTES[type_name]
            return tensor.reshape(num_experts, -1, row_bytes)

        return ExpertBlocksWeight(tuple(BlockPart(type_name, blocks_of(type_name, blocks)) for type_name, blocks in parts),
                                  in_features)

    @property
    def num_experts(self) -> int:
        return self.parts[0].blocks.shape[0]

    @property
    def out_features(self) -> int:
        """Each expert's output rows."""
        return sum(part.blocks.shape[1] for part in self.parts)

    def dequantize(self) -> torch.Tensor:
        """float32 [E, out_features, in_features], exactly gguf-py's values (the float reference's weights)."""
        return torch.cat([torch.ops.tokenmill.ggml_blocks_dequantize(
            part.blocks.reshape(-1, part.blocks.shape[2]), part.type_id, self.in_features,
            torch.arange(part.blocks.shape[0] * part.blocks.shape[1])).reshape(part.blocks.shape[0], -1, self.in_features)
            for part in self.parts], dim=1)


class GGMLBlocksExperts(CpuOnlyBlocks):
    """Experts on blocks: (rows [P, H] sorted by expert, counts [E] int64) -> [P, H] in rows' dtype, as
    worker.model.moe.StackedExperts computes it from float weights."""

    refusal = "GGML block experts run on CPU only; the loader dequantizes a GGUF file's experts for"
    kernel_path = KERNEL_PATHS["auto"]  # tests force an instruction set on an instance

    def __init__(self, gate_up: ExpertBlocksWeight, down: ExpertBlocksWeight, hidden_act: str) -> None:
        super().__init__()
        if not cpu_ops_available():
            raise RuntimeError("GGML block experts need the compiled CPU ops (scripts/build_cpu_ops.py)")
        if gate_up.num_experts != down.num_experts or gate_up.out_features != 2 * down.in_features:
            raise ValueError(f"gate/up [{gate_up.num_experts}, {gate_up.out_features}, {gate_up.in_features}] does not "
                             f"match down [{down.num_experts}, {down.out_features}, {down.in_features}]")
        self.expert_blocks = (gate_up, down)  # what worker.linears.ggml_blocks.block_weights maps and faults in
        self.hidden_act = hidden_act
        self.gelu = hidden_act == "gelu_tanh"
        self._gate_up = [part.blocks for part in gate_up.parts]
        self._gate_up_types = [part.type_id for part in gate_up.parts]
        self._down = [part.blocks for part in down.parts]
        self._down_types = [part.type_id for part in down.parts]

    def on_weights(self, gate_up: ExpertBlocksWeight, down: ExpertBlocksWeight) -> GGMLBlocksExperts:
        """The same experts on other blocks of the same values (worker.linears.ggml_repack's layout)."""
        return GGMLBlocksExperts(gate_up, down, self.hidden_act)

    @property
    def num_experts(self) -> int:
        return self.expert_blocks[0].num_experts

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:  # [P, H], [E] -> [P, H]
        offsets = F.pad(counts.cumsum(0), (1, 0))  # [E + 1]: expert e's rows offsets[e]..offsets[e + 1]
        gate, up = torch.ops.tokenmill.ggml_blocks_experts(rows, offsets, self._gate_up, self._gate_up_types,
                                                           self.kernel_path).chunk(2, dim=-1)  # each [P, I]
        hidden = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        return torch.ops.tokenmill.ggml_blocks_experts(hidden, offsets, self._down, self._down_types, self.kernel_path)

    def routed(self, x: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor) -> torch.Tensor:
        """The whole layer after its routing, as worker.model.moe.run_grouped computes it around forward() (same
        bits), in one native call: x [T, H], top_weights / top_experts [T, K] -> [T, H]."""
        return torch.ops.tokenmill.ggml_blocks_moe(x, top_weights, top_experts, self._gate_up, self._gate_up_types,
                                                   self._down, self._down_types, self.gelu, self.kernel_path)

    def extra_repr(self) -> str:
        gate_up, down = self.expert_blocks
        return (f"experts={self.num_experts}, hidden={gate_up.in_features}, intermediate={down.in_features}, "
                f"formats=gate/up {gate_up.formats}, down {down.formats}")


def describe_experts(model: nn.Module) -> str:
    """What a mixture of experts' experts run on, for the worker's log: the file's blocks (which types, how many MiB,
    which instruction set), or the float experts' dtype (a Hugging Face folder, a GGUF file's experts dequantized:
    --cpu-block-kernels off, or types it does not take)."""
    from worker.linears.ggml_blocks import AMX_MIN_ROWS, auto_path, vector_path

    on_blocks = [m for m in model.modules() if isinstance(m, GGMLBlocksExperts)]
    stacked = [m for m in model.modules() if isinstance(getattr(m, "gate_up", None), nn.Parameter)]  # StackedExperts
    described = []
    if on_blocks:
        names = {value: name for name, value in KERNEL_PATHS.items()}
        weights = [weight for m in on_blocks for weight in m.expert_blocks]
        types = sorted({part.type_name for weight in weights for part in weight.parts})
        tiles = (f" (AMX-INT8 tiles for an expert's K-quants from {AMX_MIN_ROWS} rows)"
                 if auto_path() == KERNEL_PATHS["amx_int8"] else "")
        repacked = any(part.repacked for weight in weights for part in weight.parts)  # worker.linears.ggml_repack
        blocks = "the file's blocks, its K-quants repacked at load" if repacked else "the file's own blocks"
        kernels = "the AVX2 GEMM" if repacked else f"{names[vector_path()]} integer dot products{tiles}"
        described.append(f"{len(on_blocks)} layers' experts on {blocks} ({', '.join(types)}, "
                         f"{sum(w.nbytes for w in weights) / 2**20:.0f} MiB): one native call a layer (grouping, every "
                         f"expert's gate/up and down, the weighted sum), {kernels} on activations rounded to int8 per "
                         f"256 values")
    if stacked:
        dtypes = sorted({str(m.gate_up.dtype).removeprefix("torch.") for m in stacked})
        described.append(f"{len(stacked)} layers' experts in {', '.join(dtypes)}, each expert's matmuls in torch over "
                         f"the tokens routed to it (not packed, quantized or on GGUF blocks)")
    return "; ".join(described)
