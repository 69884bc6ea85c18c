"""Swapping a model's nn.Linear modules in place: the one walk that packing (worker.linears.packed) and
quantizing at load (worker.linears.int8, worker.linears.group_quant) share."""
from __future__ import annotations

from collections.abc import Callable

from torch import nn


def replace_linears(model: nn.Module, make: Callable[[nn.Linear], nn.Module | None]) -> int:
    """Every nn.Linear under model becomes make(linear), where that is not None; returns how many did."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and (swapped := make(child)) is not None:
                setattr(parent, name, swapped)
                replaced += 1
    return replaced
