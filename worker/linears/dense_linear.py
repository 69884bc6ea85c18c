"""The one GEMM on a dense copy of a weight (worker.linears.dense_weights makes the copies): shared by the
group-quantized linear and the batch-invariant tiles, on oneDNN's pre-reordered weight."""
from __future__ import annotations

import torch


def dense_linear(x: torch.Tensor, dense_weight: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
    return torch.ops.mkldnn._linear_pointwise(x, dense_weight, None, "none", [], "")
