"""Dense copies of group-quantized weights for steps of many rows (CPU, --cpu-dense-weights).

A step of one to three rows is bound by reading the weights, so it reads the codes as the file holds
them (worker.linears.group_quant). A step of more rows (a batched decode, a prefill) is bound by arithmetic, and
there the row kernel reads the codes once per 4 rows and the strips path pays a dequantization and one
oneDNN call per strip of every weight, every step.
A copy of each weight, dequantized once in the activation dtype and reordered once into oneDNN's blocked
layout, turns that into one call per linear, which oneDNN runs on AMX tiles where the CPU has them. The
copy holds exactly the values the strips dequantize (the same rounding to bfloat16), so only the order
of the sums differs.

Measured on a 2-core Sapphire Rapids (AMX), the default model's linears at 32 rows, bfloat16, microseconds
(strips -> dense): qkv 175 -> 34, gate_up 455 -> 97, down 185 -> 48, lm_head 8386 -> 2779
(`scripts/bench_group_quant.py`, its `q4 strips bf16` and `dense bf16` columns).

The price is memory: two bytes a weight in bfloat16 beside the ~0.6 the codes take (256 MiB for the default
model). auto keeps the copies where the model runs in bfloat16 on a CPU that multiplies it natively and
they take at most MEMORY_SHARE of the memory available; on: always (float32 copies for a float32 model);
off: never.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.linears.ggml_blocks import GGMLBlocksLinear
from worker.linears.group_quant import GroupQuantLinear
from worker.memory import free_memory_bytes
from worker.native_ops import cpu_has_native_bf16
from worker.options import DENSE_WEIGHT_MODES

# auto's limit: the copies' share of the memory available when they are made (the KV cache is sized after)
MEMORY_SHARE = 0.25


def dense_weight_for(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """linear's weight dequantized to dtype (bfloat16: the strips' rounding) and reordered for oneDNN."""
    weight = linear.weight_view().dequantize().to(dtype)
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


NO_ONEDNN_BF16 = ("off: oneDNN has no bfloat16 matmul on this CPU (it needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT; "
                  "an AVX2-only CPU runs bfloat16 on the quantized kernels)")


def onednn_bf16() -> bool:
    """Whether oneDNN reorders and multiplies bfloat16 weights here (torch raises on CPUs without it)."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def decide(mode: str, dtype: torch.dtype, num_bytes: int, available_bytes: int) -> tuple[bool, str]:
    """Whether to keep the copies, and why (for the worker's log)."""
    if mode not in DENSE_WEIGHT_MODES:
        raise ValueError(f"cpu dense weights mode {mode!r} is not one of {list(DENSE_WEIGHT_MODES)}")
    size = f"{num_bytes / 2**20:.0f} MiB"
    if mode == "off":
        return False, "off (--cpu-dense-weights off)"
    if dtype == torch.bfloat16 and not onednn_bf16():  # even under on: the copies could not be made
        return False, NO_ONEDNN_BF16
    if mode == "on":
        return True, f"{size} (--cpu-dense-weights on)"
    if dtype != torch.bfloat16:
        return False, f"off: auto keeps them for bfloat16 models only (this one runs in {str(dtype).removeprefix('torch.')})"
    if not cpu_has_native_bf16():
        return False, "off: auto keeps them only where the CPU multiplies bfloat16 natively (avx512_bf16 / amx_bf16)"
    if num_bytes > MEMORY_SHARE * available_bytes:
        return False, (f"off: they would take {size}, over {MEMORY_SHARE:.0%} of the "
                       f"{available_bytes / 2**30:.1f} GiB available (--cpu-dense-weights on to keep them anyway)")
    return True, f"{size}, {num_bytes / available_bytes:.1%} of the {available_bytes / 2**30:.1f} GiB available (auto)"


def keep_dense_weights(model: nn.Module, mode: str, dtype: torch.dtype) -> str:
    """Gives every group-quantized linear under model its dense copy, or none, as mode decides; returns
    the decision in words. Linears that have one already keep it (a runner built twice over one model)."""
    blocks = [m for m in model.modules() if isinstance(m, GGMLBlocksLinear)]
    block_reason = _keep_block_copies(blocks, mode, dtype) if blocks else None
    linears = [m for m in model.modules() if isinstance(m, GroupQuantLinear) and m.codes.device.type == "cpu"]
    if not linears:  # a file with both (converted 640-wide rows beside blocks, Gemma 3's) reports both below
        return block_reason or "off: no group-quantized linears"
    reason = _keep_group_quant_copies(linears, mode, dtype)
    return reason if block_reason is None else f"{reason}; {block_reason}"


def _keep_group_quant_copies(linears: list[GroupQuantLinear], mode: str, dtype: torch.dtype) -> str:
    num_bytes = sum(m.in_features * m.out_features for m in linears) * torch.empty((), dtype=dtype).element_size()
    missing = [m for m in linears if m.dense_weight is None or m.dense_weight.dtype != dtype]
    # copies an earlier runner over this model made cost nothing more: only the missing ones are weighed
    keep, reason = decide(mode, dtype, num_bytes if missing else 0, free_memory_bytes(torch.device("cpu")))
    for linear in linears:
        if not keep:
            linear.dense_weight = None
        elif linear in missing:
            linear.dense_weight = dense_weight_for(linear, dtype)
    if keep and not missing:
        reason = f"{num_bytes / 2**20:.0f} MiB, made already (by an earlier runner over this model)"
    return f"{len(linears)} linears, {reason}" if keep else reason


def _keep_block_copies(linears: list[GGMLBlocksLinear], mode: str, dtype: torch.dtype) -> str:
    """A GGUF file's block linears (worker.linears.ggml_blocks) keep copies under `on` only: their weights are
    the file's mapped pages, and a bfloat16 copy of a Q4_K_M file is 3.5x it, past the memory rule (resident
    set <= 1.15 x the file + the KV cache + 400 MB) whatever memory the machine has. What the copies buy, and
    cost, is in docs/models.md (Qwen2.5-1.5B's shapes at 16 rows: a layer in 3.6 ms instead of 8.0)."""
    if mode not in DENSE_WEIGHT_MODES:
        raise ValueError(f"cpu dense weights mode {mode!r} is not one of {list(DENSE_WEIGHT_MODES)}")
    if mode == "on" and dtype == torch.bfloat16 and not onednn_bf16():
        mode = "off"
        for linear in linears:
            linear.dense_weight = None
        return NO_ONEDNN_BF16
    if mode != "on":
        for linear in linears:
            linear.dense_weight = None
        return (f"off: {len(linears)} linears run on the file's own blocks, and copies would take "
                f"{sum(m.in_features * m.out_features for m in linears) * 2 / 2**20:.0f} MiB, past the memory rule "
                "(--cpu-dense-weights on to keep them anyway)")
    for linear in linears:
        if linear.dense_weight is None or linear.dense_weight.dtype != dtype:
            linear.dense_weight = dense_weight_for(linear, dtype)
    num_bytes = sum(m.in_features * m.out_features for m in linears) * torch.empty((), dtype=dtype).element_size()
    return f"{len(linears)} linears on the file's blocks, {num_bytes / 2**20:.0f} MiB (--cpu-dense-weights on)"


def dense_weights_kept(model: nn.Module) -> bool:
    """Whether the model's quantized linears run many-row steps on dense copies (for reports)."""
    return any(isinstance(m, GroupQuantLinear | GGMLBlocksLinear) and m.dense_weight is not None
               for m in model.modules())
