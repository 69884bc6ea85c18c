"""--cpu-moe (llama.cpp's flag of that name): a mixture of experts' expert weights kept in host memory and run on
the CPU while everything else of the model sits on the GPU. A 30B-A3B model's experts are ~90% of its bytes but a
token reads only its top-k of them, so the GPU keeps attention, norms, the router and the KV cache, and each MoE
layer sends its routed rows to the host and the experts' outputs back:

    GPU: route -> rows [T*K, H] sorted by expert --copy--> CPU: the experts' gate/up, act, down (their own kernels:
    StackedExperts' floats, or a GGUF file's blocks, worker.linears.ggml_experts) --copy--> GPU: weighted sum

HostExperts wraps the layer's experts behind SparseMoE's seam (worker.model.moe.run_grouped) and stays where it is
when the model moves (its _apply moves nothing), so model.to("cuda") never copies the experts to the device.
"""
from __future__ import annotations

import torch
from torch import nn


class HostExperts(nn.Module):
    """A layer's experts on the CPU: (rows [P, H] sorted by expert, counts [E]) on any device -> [P, H] there."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.inner = experts

    def _apply(self, fn, recurse: bool = True):
        """Moves and casts of the model leave the experts in host memory, as they were loaded."""
        return self

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = self.inner(rows.to("cpu"), counts.to("cpu"))
        return out.to(rows.device, non_blocking=False)

