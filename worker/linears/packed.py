"""Linears with their weights reordered once into oneDNN's blocked layout (CPU, float32).

nn.Linear on CPU calls MKL sgemm on the row-major weight, which repacks panels of it on every call.
Decode steps multiply a few rows by every weight of the model, so that repacking is paid each step
and the weights stream from memory at well below the machine's bandwidth. Reordering each weight
once at load (what torch.compile's CPU freezing does) and calling oneDNN's matmul on it, measured on
this 2-core AVX2 machine over all 121 linears of the default model (scripts/bench_cpu_linear.py):
1 row 44.8 -> 30.9 ms, 8 rows 78.5 -> 42.2 ms, 32 rows 128.1 -> 84.7 ms, 512 rows 1.08x.

The ops are torch's own (torch.ops.mkldnn, the ones inductor emits); the torch pin in pyproject keeps
them. Where oneDNN is missing, pack_linears() leaves the model as it is.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.linears.swap import replace_linears


def packed_linears_supported(device: torch.device | str, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        # batch-size hint None: one layout for prefill and decode (measured equal to per-size hints)
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, None), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module) -> int:
    """Replaces every float32 CPU nn.Linear under model in place; returns how many were replaced."""
    return replace_linears(model, lambda linear: PackedLinear(linear) if packed_linears_supported(
        linear.weight.device, linear.weight.dtype) else None)
