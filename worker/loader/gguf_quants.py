"""GGUF quantized tensors -> GroupQuantWeight, exactly: the weights the file holds, not a re-quantization.

Each llama.cpp block stores codes plus a scale (and a minimum or an implied offset) per group; every
format here maps onto W = scale * code + min with unsigned codes, and the products involved are exact in
float32 (f16 scales times codes of at most 8 bits), so group_quant's dequantize() equals gguf-py's
dequantize bit for bit (tests/worker/test_gguf_quants.py). Block layouts, from ggml-common.h:
  Q4_0  [d f16][16 B: 32 nibbles]           w = d * (q - 8)
  Q4_1  [d f16][m f16][16 B]                w = d * q + m
  Q8_0  [d f16][32 x int8]                  w = d * q
  Q5_0  [d f16][4 B: 32 high bits][16 B]    w = d * (q - 16)     (q: nibble | high bit << 4)
  Q5_1  [d f16][m f16][4 B][16 B]           w = d * q + m
  Q4_K  256 per block: [d][dmin][12 B six-bit scales/mins x 8][128 B nibbles]  w = d*sc_j*q - dmin*m_j
  Q5_K  as Q4_K plus [32 B high bits] before the nibbles                       (5-bit q)
  Q6_K  [128 B low nibbles][64 B high 2 bits][16 x int8 scales][d f16]         w = d*sc_j*(q - 32), 16 per scale
"""
from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch

from worker.linears.ggml_blocks import GGMLBlocksWeight, block_supported
from worker.linears.group_quant import GroupQuantWeight, pack_nibbles

QK_K = 256


def _f16(column: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32).reshape(-1)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins per block."""
    packed = packed.reshape(-1, 3, 4)
    d, m, m_d = packed[:, 0], packed[:, 1], packed[:, 2]
    scales = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _nibble_chunks(qs: np.ndarray) -> np.ndarray:
    """K-quant nibbles: each 32-byte chunk holds 64 codes, low nibbles first, then high. -> [blocks, 256]"""
    chunks = qs.reshape(qs.shape[0], -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(qs.shape[0], -1)


def _convert(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """blocks: [n_blocks, bytes] -> (codes [n_blocks, ...] uint8, scales, mins [n_blocks, groups], bits, group)."""
    n = blocks.shape[0]
    if type_name == "Q4_0":
        d = _f16(blocks[:, 0:2])
        return blocks[:, 2:18], d[:, None], (-8.0 * d)[:, None], 4, 32
    if type_name == "Q4_1":
        return blocks[:, 4:20], _f16(blocks[:, 0:2])[:, None], _f16(blocks[:, 2:4])[:, None], 4, 32
    if type_name == "Q8_0":
        d = _f16(blocks[:, 0:2])
        codes = (blocks[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return codes, d[:, None], (-128.0 * d)[:, None], 8, 32
    if type_name in ("Q5_0", "Q5_1"):
        d = _f16(blocks[:, 0:2])
        offset = 2 if type_name == "Q5_0" else 4
        high = np.ascontiguousarray(blocks[:, offset:offset + 4]).view(np.uint32).reshape(n, 1)
        high = ((high >> np.arange(32, dtype=np.uint32).reshape(1, 32)) & 1).astype(np.uint8)
        packed = blocks[:, offset + 4:offset + 20]
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1) | (high << 4)  # elements 0..15, 16..31
        mins = -16.0 * d if type_name == "Q5_0" else _f16(blocks[:, 2:4])
        return codes, d[:, None], mins[:, None], 8, 32
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scale_min(blocks[:, 4:16])
        scales, mins = d[:, None] * sc, -(dmin[:, None] * mn)
        if type_name == "Q4_K":
            codes = _nibble_chunks(blocks[:, 16:144])
            return pack_nibbles(torch.from_numpy(codes.reshape(-1, 32))).numpy().reshape(n, -1), scales, mins, 4, 32
        high = blocks[:, 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        codes = _nibble_chunks(blocks[:, 48:176]) | ((high & 0x01).reshape(n, -1) << 4)
        return codes, scales, mins, 8, 32
    if type_name == "Q6_K":
        low = blocks[:, 0:128].reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        low = (low & 0x0F).reshape(n, -1, 32)
        high = blocks[:, 128:192].reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        high = (high & 0x03).reshape(n, -1, 32)
        codes = (low | (high << 4)).reshape(n, -1)
        scales = _f16(blocks[:, 208:210])[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
        return codes, scales, -32.0 * scales, 8, 16
    raise KeyError(type_name)


SUPPORTED_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def group_quant_from_gguf(tensor) -> GroupQuantWeight | None:
    """A gguf ReaderTensor of a 2-D weight -> its GroupQuantWeight; None for types kept as floats (F32,
    F16, BF16) or not mapped here (those are dequantized by the caller, as before)."""
    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TYPES or len(tensor.shape) != 2:
        return None
    in_features, out_features = (int(d) for d in tensor.shape.tolist())  # GGUF lists the innermost dim first
    return group_quant_from_blocks(type_name, np.asarray(tensor.data), out_features, in_features)


def ggml_blocks_from_gguf(tensor, types: Collection[str]) -> GGMLBlocksWeight | None:
    """A gguf ReaderTensor of a 2-D weight -> its blocks as the file maps them (no copy), where its type is one
    of types and a compiled kernel runs it at that row length; None otherwise (the caller converts or
    dequantizes)."""
    type_name = tensor.tensor_type.name
    if len(tensor.shape) != 2 or type_name not in types:
        return None
    in_features, out_features = (int(d) for d in tensor.shape.tolist())
    if not block_supported(type_name, in_features):
        return None
    return GGMLBlocksWeight.from_blocks(type_name, np.asarray(tensor.data).view(np.uint8), out_features, in_features)


def group_quant_from_blocks(type_name: str, data: np.ndarray, out_features: int, in_features: int) -> GroupQuantWeight:
    """A weight's GGML blocks (any shape holding out_features rows of them) -> its GroupQuantWeight."""
    blocks = np.ascontiguousarray(data).reshape(out_features, -1).view(np.uint8)
    per_block = QK_K if type_name.endswith("_K") else 32
    blocks = blocks.reshape(out_features * (in_features // per_block), -1)
    codes, scales, mins, bits, group = _convert(type_name, blocks)
    return GroupQuantWeight(
        torch.from_numpy(np.ascontiguousarray(codes).reshape(out_features, -1)),
        torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(out_features, -1)),
        torch.from_numpy(np.ascontiguousarray(mins, dtype=np.float32).reshape(out_features, -1)),
        bits, group, type_name,
    )
