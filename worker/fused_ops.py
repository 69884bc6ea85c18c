"""Puts a model's decoder on the compiled decoder ops (worker/csrc/decoder_ops.cpp; see worker.model).

Why: at a few decode rows a step of plain torch was ~5,000 ATen calls (the default model, 30 layers),
each costing more than its arithmetic, and decode attention gathered every request's pages into a
contiguous copy per layer before attending. The fused modules make ~11 calls per layer and read the
pages in place. The plain-torch modules stay the reference: tests/worker/test_decoder_ops.py holds
each op and the whole model to them.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from worker.model import MLP, Attention, DecoderLayer, LlamaModel, RMSNorm
from worker.native_ops import cpu_ops_available

log = logging.getLogger(__name__)

_FUSED_MODULES = (RMSNorm, Attention, MLP, DecoderLayer)


def use_fused_ops(model: LlamaModel) -> bool:
    """Switches every norm, attention, MLP and layer of model to the compiled ops (CPU tensors, float32
    or bfloat16); returns False, changing nothing, where the ops are not built or the dtype has none."""
    dtype = model.norm.weight.dtype  # the model dtype (an embedding may be quantized)
    if not cpu_ops_available():
        return False
    if dtype not in (torch.float32, torch.bfloat16):
        log.warning("compiled decoder ops not used: they run float32 and bfloat16, the model is %s", dtype)
        return False
    set_fused(model, True)
    return True


def set_fused(model: nn.Module, fused: bool) -> None:
    for module in model.modules():
        if isinstance(module, _FUSED_MODULES):
            module.fused = fused
