"""The AMX-BF16 tiles of the GGML block linears (worker/csrc/ggml_blocks_amx_bf16.cpp) against gguf-py.

Every type with a kernel, rows of x around the tiles' 16 and the kernel's pairs of tiles, weight rows around its
chunks of 32, K not a multiple of 256 where the type allows it. The reference: x rounded to bfloat16 as torch
rounds it, times gguf-py's dequantized weight rounded the same way, in float64: those are the tiles' inputs
exactly, so only the float32 sums' order differs. Skipped, with the reason, on a CPU without AMX-BF16.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tests.worker.linears.test_ggml_blocks import random_blocks, shapes
from worker.linears.ggml_blocks import (BLOCK_TYPES, GGMLBlocksLinear, GGMLBlocksWeight, amx_bf16_usable,
                                        describe_block_kernels, dot_rows)
from worker.native_ops import cpu_flags, cpu_ops_available

NO_AMX_BF16 = "this CPU lacks amx_tile + amx_bf16 (with avx512_bf16), or Linux refused the tile state"
pytestmark = [pytest.mark.skipif(not cpu_ops_available(), reason="the compiled CPU ops are not built"),
              pytest.mark.skipif(not (cpu_ops_available() and amx_bf16_usable()), reason=NO_AMX_BF16)]

ROWS = (1, 5, 16, 17, 40, 64, 200)


def tiles(x: torch.Tensor, raws: list[np.ndarray], types: list[str], bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.tokenmill.ggml_blocks_linear_bf16_tiles(x, [torch.from_numpy(r) for r in raws],
                                                            [BLOCK_TYPES[t] for t in types], bias)


def bf16_reference(x: torch.Tensor, weight: np.ndarray) -> np.ndarray:
    w = torch.from_numpy(weight).to(torch.bfloat16).double().numpy()
    return x.to(torch.bfloat16).double().numpy() @ w.T


@pytest.mark.parametrize("type_name, cols", list(shapes()))
def test_the_tiles_equal_bfloat16_inputs_then_matmul(type_name, cols):
    out_rows = 45  # one whole chunk of 32, then a chunk of 13: one A tile, part of it past the weight
    raw = random_blocks(type_name, out_rows, cols)
    weight = dequantize(raw, GGMLQuantizationType[type_name]).reshape(out_rows, cols)
    for rows in ROWS:
        x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
        got = tiles(x, [raw], [type_name])
        assert got.dtype == torch.float32 and got.shape == (rows, out_rows)
        exact = bf16_reference(x, weight)
        assert np.abs(got.double().numpy() - exact).max() <= 1e-5 * np.abs(exact).max(), (type_name, cols, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_projection_with_a_bias_is_its_parts_side_by_side(dtype):
    """Q4_K_M's q/k/v: each part as if alone, the bias added in float32, the output in x's dtype."""
    cols = 512
    parts = [("Q4_K", 72), ("Q4_K", 8), ("Q6_K", 24)]
    raws = [random_blocks(t, n, cols, seed=i) for i, (t, n) in enumerate(parts)]
    types = [t for t, _ in parts]
    x = torch.randn(33, cols).to(dtype)
    bias = torch.randn(104)
    fused = tiles(x, raws, types, bias)
    # x's values in float32 (exact for bfloat16 x, which the kernel rounds to itself): the float32 sums
    alone = torch.cat([tiles(x.float(), [r], [t]) for r, t in zip(raws, types)], 1)
    assert fused.dtype == dtype
    assert torch.equal(fused, (alone + bias).to(dtype))


def test_the_linears_strips_run_on_the_tiles_here():
    """On this CPU a many-row step's strips are the tiles: the same values as dequantizing strips for oneDNN,
    up to the order of the float32 sums."""
    cols = 1536
    weight = GGMLBlocksWeight.concat_rows([GGMLBlocksWeight.from_blocks("Q4_K", random_blocks("Q4_K", 96, cols), 96, cols),
                                           GGMLBlocksWeight.from_blocks("Q6_K", random_blocks("Q6_K", 32, cols, 1), 32, cols)])
    linear = GGMLBlocksLinear(weight, torch.randn(128))
    x = torch.randn(300, cols).to(torch.bfloat16)
    got = linear.forward_strips(x)
    assert torch.equal(got, tiles(x, [p.blocks.numpy() for p in weight.parts], ["Q4_K", "Q6_K"], linear.bias))
    assert x.shape[0] > dot_rows() and torch.equal(linear(x), got)  # the linear's own choice past dot_rows()
    assert "AMX-BF16 tiles on 32 weight rows at a time dequantized to bfloat16 past that" in \
        describe_block_kernels(torch.nn.Sequential(linear))
    onednn = linear.forward_dequantized_strips(x)
    scale = onednn.float().abs().max()
    assert (got.float() - onednn.float()).abs().max() <= 0.02 * scale  # both rounded to bfloat16 at the end


def test_bad_inputs_name_what_is_wrong():
    blocks = torch.from_numpy(random_blocks("Q4_K", 4, 256))
    with pytest.raises(RuntimeError, match="in_features 100 is not a multiple of 32"):
        torch.ops.tokenmill.ggml_blocks_linear_bf16_tiles(torch.randn(1, 100), [blocks], [BLOCK_TYPES["Q4_K"]])
    with pytest.raises(RuntimeError, match="in_features 288 is not a multiple of 256"):
        torch.ops.tokenmill.ggml_blocks_linear_bf16_tiles(torch.randn(1, 288), [blocks], [BLOCK_TYPES["Q4_K"]])
    with pytest.raises(RuntimeError, match=r"part 0 must be contiguous uint8 \[N, 144\]"):
        torch.ops.tokenmill.ggml_blocks_linear_bf16_tiles(torch.randn(1, 256), [blocks[:, :100]], [BLOCK_TYPES["Q4_K"]])
    with pytest.raises(RuntimeError, match="part 0 is repacked"):
        torch.ops.tokenmill.ggml_blocks_linear_bf16_tiles(torch.randn(1, 256), [blocks], [BLOCK_TYPES["Q4_K"] + 256])


def test_the_flags_agree_with_the_op():
    assert {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags()
