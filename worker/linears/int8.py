"""INT8 weight-only quantization: every nn.Linear of a loaded model becomes an Int8Linear.

Weights are stored as int8 with one float scale per output channel (symmetric, absmax / 127);
activations stay in the model dtype. Embeddings and norms keep their weights: the embedding is a
lookup, not a matmul (a tied lm_head still gets its own int8 copy), and norms are a few KB.
On CUDA the matmul is the Triton kernel that dequantizes inside its K loop; elsewhere the torch
path, which reads the same int8 weights and scales.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.linears.swap import replace_linears


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear, use_kernel: bool) -> None:
        super().__init__()
        from worker.kernels.int8_matmul import quantize_int8_weight

        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight_q, scales = quantize_int8_weight(linear.weight.detach())  # [N, K] int8, [N]
        self.register_buffer("weight_q", weight_q)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.use_kernel = use_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        from worker.kernels.int8_matmul import int8_weight_matmul, int8_weight_matmul_torch

        matmul = int8_weight_matmul if self.use_kernel else int8_weight_matmul_torch
        return matmul(x, self.weight_q, self.scales, bias=self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.use_kernel}"


def quantize_linears_int8(model: nn.Module, use_kernel: bool) -> int:
    """Replaces every nn.Linear under model in place; returns how many were replaced."""
    return replace_linears(model, lambda linear: Int8Linear(linear, use_kernel))
