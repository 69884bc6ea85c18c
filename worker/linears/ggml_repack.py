"""K-quant block linears repacked once at load for the AVX2 GEMM (issue 34), on a CPU whose auto path is that GEMM
(AVX2 without AVX-512 VNNI): the GEMM otherwise transposes every 8 rows' blocks on every call, which at one row
of x (a decode step) cost about as much as its arithmetic. The layout (worker/csrc/ggml_blocks_repack.cpp) keeps
the file's size (Q6_K exactly, Q4_K / Q5_K 2-3% more), and the file's pages of each repacked tensor are given
back (madvise MADV_DONTNEED), so memory stays about one copy of the file.

What else reads a repacked weight: a long prefill's dequantized strips, a dense copy and an embedding that a tied
lm_head shares all go through the dequantizer, which unpacks row by row (exactly the file's values); the
deterministic mode keeps the file's blocks (worker.build repacks only without it), and so do tensor-parallel
ranks (their shards are cut from the file's layout).

A mixture of experts' stacked expert blocks [E, rows, row bytes] repack the same way, every expert's rows in
groups of 8 that never straddle two experts (an expert's rows are a multiple of 8), so expert e's repacked rows
start at e * rows * the repacked row bytes, where its file rows started at e * rows * the file's.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
from pathlib import Path

import torch
from torch import nn

from worker.linears.ggml_blocks import (BLOCK_TYPES, KERNEL_PATHS, REPACKED_BYTES, BlockPart, GGMLBlocksEmbedding,
                                        GGMLBlocksLinear, GGMLBlocksWeight, PartsOfBlocks, auto_path)
from worker.linears.ggml_experts import ExpertBlocksWeight, GGMLBlocksExperts

log = logging.getLogger(__name__)
MADV_DONTNEED = 4  # Linux's value (mmap.MADV_DONTNEED where Python has it)
GROUP_ROWS = 8  # a repacked group's weight rows


def repacks_here() -> bool:
    """Whether auto runs the K-quants on the AVX2 GEMM on this CPU (the compiled ops loaded)."""
    return auto_path() == KERNEL_PATHS["avx2_gemm"]


def repackable(weight: PartsOfBlocks) -> bool:
    """A weight (or an expert's, stacked) whose every part starts on a group of 8 rows, with at least one K-quant
    part to repack."""
    return (all(part.blocks.shape[-2] % GROUP_ROWS == 0 for part in weight.parts)
            and any(part.type_name in REPACKED_BYTES and not part.repacked for part in weight.parts))


def repacked_weight(weight: GGMLBlocksWeight | ExpertBlocksWeight) -> GGMLBlocksWeight | ExpertBlocksWeight:
    """The weight with its K-quant parts repacked (copies); other types' parts stay as they are. Stacked experts'
    parts repack as one tensor of every expert's rows (groups never straddle two experts)."""
    parts = []
    for part in weight.parts:
        if part.type_name in REPACKED_BYTES and not part.repacked:
            rows = part.blocks.reshape(-1, part.blocks.shape[-1])
            blocks = torch.ops.tokenmill.ggml_blocks_repack(rows, BLOCK_TYPES[part.type_name], weight.in_features)
            part = BlockPart(part.type_name, blocks.reshape(*part.blocks.shape[:-1], -1), repacked=True)
        parts.append(part)
    return type(weight)(tuple(parts), weight.in_features)


def repack_linears(model: nn.Module) -> int:
    """Every repackable GGMLBlocksLinear of the model swapped for one on its repacked weight (an embedding sharing
    that weight, a tied lm_head's, follows it), and every mixture-of-experts' GGMLBlocksExperts for one on its
    repacked expert blocks, each tensor's file pages given back as soon as it is copied. Does nothing where auto
    does not run the AVX2 GEMM. Returns how many weights were repacked (an experts' gate/up and down: two)."""
    if not repacks_here():
        return 0
    mappings = _file_mappings()
    done: dict[int, PartsOfBlocks] = {}  # id(original weight) -> repacked

    def repacked(original: PartsOfBlocks) -> PartsOfBlocks:
        if id(original) not in done and repackable(original):
            done[id(original)] = repacked_weight(original)
            _give_back(original, mappings)
        return done.get(id(original), original)

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, GGMLBlocksLinear) and repackable(child.weight_blocks):
                setattr(parent, name, GGMLBlocksLinear(repacked(child.weight_blocks), child.bias))
            elif isinstance(child, GGMLBlocksExperts) and any(map(repackable, child.expert_blocks)):
                setattr(parent, name, child.on_weights(*map(repacked, child.expert_blocks)))
    for module in model.modules():  # a tied embedding reads its rows from the repacked copy
        if isinstance(module, GGMLBlocksEmbedding) and id(module.weight_blocks) in done:
            module.weight_blocks = done[id(module.weight_blocks)]
    log.info("repacked %d K-quant block weights for the AVX2 GEMM", len(done))
    return len(done)


def _give_back(weight: GGMLBlocksWeight, mappings: list[tuple[int, int]]) -> None:
    """The repacked parts' file pages out of this process (they stay in the page cache, never read again here).
    Only pages of a file mapping: anonymous memory (a copy the loader made) would be zeroed, and is freed when
    the last reference goes. The pages a tensor shares at its ends go too: a read-only file page dropped from
    the process is faulted back in from the page cache, should a neighbouring tensor read it."""
    page = mmap.PAGESIZE
    for part in weight.parts:
        if part.type_name not in REPACKED_BYTES:
            continue
        start, size = part.blocks.data_ptr(), part.blocks.numel()
        if not any(lo <= start and start + size <= hi for lo, hi in mappings):
            continue
        first, last = start // page * page, -(-(start + size) // page) * page  # mappings start and end on pages
        if _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED):
            log.warning("madvise(MADV_DONTNEED) failed (errno %d): the file's pages stay resident", ctypes.get_errno())


def _file_mappings() -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of files (an inode), from /proc/self/maps; none elsewhere."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[4] != "0":
            lo, hi = (int(value, 16) for value in fields[0].split("-"))
            found.append((lo, hi))
    return found


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc
