"""GGML block linears (worker/csrc/ggml_blocks_dot.cpp, worker.linears.ggml_blocks) against gguf-py.

Every type with a kernel, every instruction set this CPU has (forced; avx2_gemm: the K-quants on the AVX2 GEMM,
the rest on the AVX2 vector kernel), rows 1, 3, 5, 16, 64 and 512, rows of K not a multiple of 256 where the
type allows it. The reference: x rounded to int8 per 256 values exactly as
the kernel's q8_K (absmax / 127, half to even), times gguf-py's dequantized weight, in float64: the kernel's
integer sums are exact, so only its float32 accumulation differs (relative 1e-5). Against the unrounded x the
error is the activations' rounding, checked loosely. Dequantization is bit-exact to gguf-py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from worker.linears.ggml_blocks import (BLOCK_ELEMENTS, BLOCK_TYPES, KERNEL_PATHS, GGMLBlocksEmbedding, GGMLBlocksLinear,
                                        GGMLBlocksWeight, block_supported, dot_rows)
from worker.native_ops import cpu_flags, cpu_ops_available

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="the compiled CPU ops are not built")

# where each type's f16 scales (d, and dmin / m where it has one) sit in its block
SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,),
                 "Q4_1": (0, 2), "Q5_1": (0, 2), "IQ4_NL": (0,), "IQ4_XS": (0,),
                 "Q2_K": (80, 82), "Q3_K": (108,)}
ROWS = (1, 3, 5, 16, 64, 512)


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    from gguf.constants import GGML_QUANT_SIZES

    per, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // per, nbytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[type_name]:  # finite f16 scales; every other byte is any code
        scales = rng.uniform(1e-3, 1e-2, size=(rows, cols // per)).astype(np.float16)
        raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(rows, cols // per, 2)
    return raw.reshape(rows, -1)


def q8k_rounded(x: np.ndarray) -> np.ndarray:
    """x as the kernel rounds it: int8 per block of 256 (a short last block alone), scale absmax / 127."""
    rows, cols = x.shape
    blocks = -(-cols // 256)
    padded = np.zeros((rows, blocks * 256), np.float32)
    padded[:, :cols] = x
    padded = padded.reshape(rows, blocks, 256)
    scale = (np.abs(padded).max(-1) / np.float32(127)).astype(np.float32)
    inverse = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    q = np.round(padded * inverse[..., None])
    return (q.astype(np.float64) * scale[..., None]).reshape(rows, -1)[:, :cols]


WIDE_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
AMX_FLAGS = WIDE_FLAGS | {"avx512_bf16", "amx_tile", "amx_int8"}
NO_AMX = "this CPU lacks amx_tile + amx_int8 (with avx512_vnni, avx512_bf16), or Linux refused the tile state"


def amx_usable() -> bool:
    """The CPU's flags say AMX-INT8, and the op got the tile state from Linux (arch_prctl can refuse it, e.g.
    to a process whose signal stacks are too small for it)."""
    if not (cpu_ops_available() and AMX_FLAGS <= cpu_flags()):
        return False
    try:
        return torch.ops.tokenmill.ggml_blocks_path(KERNEL_PATHS["amx_int8"]) == KERNEL_PATHS["amx_int8"]
    except RuntimeError:
        return False


def available_paths() -> list:
    flags = cpu_flags()
    return [pytest.param("avx2", id="avx2"), pytest.param("avx2_gemm", id="avx2_gemm"),
            pytest.param("avx512_vnni", id="avx512_vnni", marks=pytest.mark.skipif(
                not WIDE_FLAGS <= flags, reason="this CPU lacks avx512f/bw/vl/dq + avx512_vnni")),
            pytest.param("amx_int8", id="amx_int8", marks=pytest.mark.skipif(not amx_usable(), reason=NO_AMX))]


def shapes():
    for type_name in BLOCK_TYPES:
        columns = (512, 1536) if BLOCK_ELEMENTS[type_name] == 256 else (96, 640)  # 96, 640: not multiples of 256
        for cols in columns:
            yield pytest.param(type_name, cols, id=f"{type_name}-K{cols}")


@pytest.mark.parametrize("path", available_paths())
@pytest.mark.parametrize("type_name, cols", list(shapes()))
def test_the_kernel_equals_gguf_dequantize_then_matmul(type_name, cols, path):
    out_rows = 37  # not a multiple of any tile
    raw = random_blocks(type_name, out_rows, cols)
    weight = dequantize(raw, GGMLQuantizationType[type_name]).reshape(out_rows, cols).astype(np.float64)
    blocks = torch.from_numpy(raw)
    rng = np.random.default_rng(1)
    for rows in ROWS:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        got = torch.ops.tokenmill.ggml_blocks_linear(torch.from_numpy(x), [blocks], [BLOCK_TYPES[type_name]],
                                                     KERNEL_PATHS[path]).numpy()
        exact = q8k_rounded(x) @ weight.T
        assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max(), (type_name, cols, rows, path)
        plain = x.astype(np.float64) @ weight.T  # the activations' rounding, loosely
        assert np.abs(got - plain).max() <= 0.05 * np.abs(plain).max()


@pytest.mark.parametrize("path", available_paths())
def test_a_fused_projection_of_three_types_shares_one_rounding(path):
    """Q4_K_M's q/k/v: the parts' outputs side by side, each as if alone, on every path."""
    cols = 512
    parts = [("Q4_K", 40), ("Q4_K", 8), ("Q6_K", 8)]
    raws = [random_blocks(t, n, cols, seed=i) for i, (t, n) in enumerate(parts)]
    x = torch.randn(5, cols)
    fused = torch.ops.tokenmill.ggml_blocks_linear(x, [torch.from_numpy(r) for r in raws],
                                                   [BLOCK_TYPES[t] for t, _ in parts], KERNEL_PATHS[path])
    alone = torch.cat([torch.ops.tokenmill.ggml_blocks_linear(x, [torch.from_numpy(r)], [BLOCK_TYPES[t]],
                                                              KERNEL_PATHS[path]) for r, (t, _) in zip(raws, parts)], 1)
    assert torch.equal(fused, alone)


def test_auto_takes_the_widest_path_this_cpu_has():
    flags = cpu_flags()
    expected = 3 if amx_usable() else 2 if WIDE_FLAGS <= flags else 4  # 4: AVX2 with its GEMM for the K-quants
    assert torch.ops.tokenmill.ggml_blocks_path(0) == expected


def q4_k_m_like_projection(cols: int = 1536):
    """A fused projection of Q4_K, Q6_K and Q8_0 parts (64 rows, a bias): (blocks, types, bias, its linear)."""
    parts = [("Q4_K", 32), ("Q6_K", 16), ("Q8_0", 16)]
    blocks = [torch.from_numpy(random_blocks(t, n, cols, seed=i)) for i, (t, n) in enumerate(parts)]
    types = [BLOCK_TYPES[t] for t, _ in parts]
    bias = torch.randn(64)
    linear = GGMLBlocksLinear(GGMLBlocksWeight.concat_rows(
        [GGMLBlocksWeight.from_blocks(t, b.numpy(), n, cols) for b, (t, n) in zip(blocks, parts)]), bias)
    return blocks, types, bias, linear


@pytest.mark.skipif(not amx_usable(), reason=NO_AMX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_runs_the_k_quants_on_tiles_from_six_rows_and_forward_rows_never(dtype):
    """Under auto, a Q4_K_M-like fused projection (Q4_K + Q6_K beside Q8_0) gives the tiles' bits from 6 rows
    and the vector kernel's below; forward_rows (the deterministic mode's) keeps the vector kernel at every
    count, so a row's bits do not depend on the others."""
    assert_auto_takes("amx_int8", "avx512_vnni", 6, (5, 6, 40), dtype)


def assert_auto_takes(fast: str, vector: str, from_rows: int, counts: tuple[int, ...], dtype: torch.dtype) -> None:
    """On q4_k_m_like_projection, auto gives the fast path's bits from from_rows rows of x and the vector kernel's
    below; forward_rows keeps the vector kernel at every count."""
    blocks, types, bias, linear = q4_k_m_like_projection()
    for rows in counts:
        x = torch.randn(rows, linear.in_features).to(dtype)
        fast_out = torch.ops.tokenmill.ggml_blocks_linear(x, blocks, types, KERNEL_PATHS[fast], bias)
        vector_out = torch.ops.tokenmill.ggml_blocks_linear(x, blocks, types, KERNEL_PATHS[vector], bias)
        if dtype == torch.float32:  # the two sum in different orders (bfloat16's rounding may hide it)
            assert not torch.equal(fast_out[:, :48], vector_out[:, :48])
        assert torch.equal(fast_out[:, 48:], vector_out[:, 48:])  # Q8_0 has neither
        assert torch.equal(linear(x), fast_out if rows >= from_rows else vector_out), rows
        assert torch.equal(linear.forward_rows(x), vector_out), rows
        assert torch.equal(linear.forward_rows(x)[:3], linear.forward_rows(x[:3]))


AVX2_ONLY = "auto takes the AVX2 GEMM only on a CPU without avx512_vnni (and AMX)"


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_avx2_gemm_sums_each_row_alone(type_name):
    """The GEMM (8 weight rows a register, 4 rows of x a tile) gives a row of x the same bits alone, in a tile of
    4, in a tile's remainder, or with a short last group of weight rows: its integer sums are exact and its float
    accumulation is one row's, in block order."""
    cols, out_rows = 768, 21  # 21 weight rows: two groups of 8 and one of 5
    blocks = torch.from_numpy(random_blocks(type_name, out_rows, cols, seed=4))
    x = torch.randn(11, cols, generator=torch.Generator().manual_seed(5))
    gemm = KERNEL_PATHS["avx2_gemm"]
    many = torch.ops.tokenmill.ggml_blocks_linear(x, [blocks], [BLOCK_TYPES[type_name]], gemm)
    for row in (0, 5, 9, 10):
        alone = torch.ops.tokenmill.ggml_blocks_linear(x[row:row + 1], [blocks], [BLOCK_TYPES[type_name]], gemm)
        assert torch.equal(alone[0], many[row]), row
    part = torch.ops.tokenmill.ggml_blocks_linear(x, [blocks[8:21]], [BLOCK_TYPES[type_name]], gemm)
    assert torch.equal(part, many[:, 8:])


@pytest.mark.skipif(amx_usable() or WIDE_FLAGS <= cpu_flags(), reason=AVX2_ONLY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_auto_runs_the_k_quants_on_the_avx2_gemm_from_one_row_and_forward_rows_never(dtype):
    """Under auto a Q4_K_M-like fused projection gives the GEMM's bits at every count, one row included (it reads
    the weight faster there too); forward_rows keeps the vector kernel at every count."""
    assert_auto_takes("avx2_gemm", "avx2", 1, (1, 2, 40), dtype)


@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_dequantize_is_gguf_py_bit_for_bit(type_name):
    cols = 512
    raw = random_blocks(type_name, 9, cols)
    expected = dequantize(raw, GGMLQuantizationType[type_name]).reshape(9, cols)
    weight = GGMLBlocksWeight.from_blocks(type_name, raw, 9, cols)
    rows = torch.tensor([3, 0, 8, 3])
    assert np.array_equal(weight.dequantize(rows).numpy(), expected[[3, 0, 8, 3]])
    assert np.array_equal(weight.dequantize().numpy(), expected)
    bf16 = torch.ops.tokenmill.ggml_blocks_dequantize_bf16(torch.from_numpy(raw), BLOCK_TYPES[type_name], cols, 2, 7)
    assert torch.equal(bf16, torch.from_numpy(expected[2:7]).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_linear_switches_to_strips_past_dot_rows_with_the_same_result(dtype):
    cols = 512
    weight = GGMLBlocksWeight.concat_rows([GGMLBlocksWeight.from_blocks("Q4_K", random_blocks("Q4_K", 48, cols), 48, cols),
                                           GGMLBlocksWeight.from_blocks("Q6_K", random_blocks("Q6_K", 16, cols, 1), 16, cols)])
    bias = torch.randn(64)
    linear = GGMLBlocksLinear(weight, bias)
    limit = dot_rows()  # 64 with AMX tiles, 512 on the AVX2 GEMM, else 24
    x = torch.randn(limit + 40, cols).to(dtype)
    reference = x.double() @ weight.dequantize().double().T + bias.double()
    many = linear(x)  # strips
    assert many.dtype == dtype and many.shape == (limit + 40, 64)
    assert torch.equal(many, linear.forward_strips(x))
    few = linear(x[:limit])  # the integer kernel
    scale = reference.abs().max()
    assert (many.double() - reference).abs().max() <= 0.02 * scale
    assert (few.double() - reference[:limit]).abs().max() <= 0.05 * scale
    assert torch.equal(linear.forward_rows(x)[:3], linear.forward_rows(x[:3]))  # a row's bits alone or among others


def test_the_embedding_looks_up_rows_of_its_blocks():
    raw = random_blocks("Q6_K", 30, 256)
    embedding = GGMLBlocksEmbedding(GGMLBlocksWeight.from_blocks("Q6_K", raw, 30, 256), torch.bfloat16)
    ids = torch.tensor([[4, 29], [0, 4]])
    expected = dequantize(raw, GGMLQuantizationType.Q6_K).reshape(30, 256)
    out = embedding(ids)
    assert out.shape == (2, 2, 256) and out.dtype == torch.bfloat16
    assert torch.equal(out[0, 1], torch.from_numpy(expected[29]).to(torch.bfloat16))


def test_bad_inputs_name_what_is_wrong():
    assert not block_supported("Q4_K", 640) and not block_supported("IQ2_XXS", 512) and block_supported("Q8_0", 96)
    with pytest.raises(ValueError, match="Q4_K blocks of 640 values a row have no kernel"):
        GGMLBlocksWeight.from_blocks("Q4_K", np.zeros((2, 360), np.uint8), 2, 640)
    with pytest.raises(ValueError, match=r"uint8 \[rows, 144\]"):
        GGMLBlocksWeight.from_blocks("Q4_K", np.zeros((2, 140), np.uint8), 2, 256)
    blocks = torch.from_numpy(random_blocks("Q4_K", 4, 256))
    with pytest.raises(RuntimeError, match="in_features 100 is not a multiple of 256"):
        torch.ops.tokenmill.ggml_blocks_linear(torch.randn(1, 100), [blocks], [BLOCK_TYPES["Q4_K"]], 0)
    with pytest.raises(RuntimeError, match="no kernel for GGML type 16"):  # IQ2_XXS
        torch.ops.tokenmill.ggml_blocks_linear(torch.randn(1, 256), [blocks], [16], 0)
    with pytest.raises(RuntimeError, match=r"row 4 is outside \[0, 4\)"):
        torch.ops.tokenmill.ggml_blocks_dequantize(blocks, BLOCK_TYPES["Q4_K"], 256, torch.tensor([4]))
    with pytest.raises(RuntimeError, match=r"path 5 is not 0 \(auto\), 1 \(avx2\), .* or 4 \(avx2_gemm\)"):
        torch.ops.tokenmill.ggml_blocks_linear(torch.randn(1, 256), [blocks], [BLOCK_TYPES["Q4_K"]], 5)
    linear = GGMLBlocksLinear(GGMLBlocksWeight.from_blocks("Q4_K", blocks, 4, 256))
    with pytest.raises(ValueError, match="CPU only"):
        linear.to("meta")


def test_dense_copies_only_when_asked():
    """auto keeps none (the blocks are the file's pages; a copy is 3.5x a Q4_K_M file); on keeps one, which
    serves steps of DENSE_ROWS rows or more and holds exactly the blocks' values."""
    from worker.linears.dense_weights import NO_ONEDNN_BF16, dense_weights_kept, keep_dense_weights, onednn_bf16
    from worker.linears.group_quant import DENSE_ROWS

    if not onednn_bf16():  # an AVX2-only CPU: even on keeps none, and says why
        model = torch.nn.Sequential(GGMLBlocksLinear(GGMLBlocksWeight.from_blocks("Q4_K", random_blocks("Q4_K", 32, 256), 32, 256)))
        assert keep_dense_weights(model, "on", torch.bfloat16) == NO_ONEDNN_BF16 and not dense_weights_kept(model)
        pytest.skip("oneDNN has no bfloat16 matmul on this CPU: the copies' arithmetic is not checkable here")

    cols = 256
    raw = random_blocks("Q4_K", 32, cols)
    model = torch.nn.Sequential(GGMLBlocksLinear(GGMLBlocksWeight.from_blocks("Q4_K", raw, 32, cols)))
    assert keep_dense_weights(model, "auto", torch.bfloat16).startswith("off: 1 linears run on the file's own blocks")
    assert not dense_weights_kept(model)
    assert "(--cpu-dense-weights on)" in keep_dense_weights(model, "on", torch.bfloat16)
    linear = model[0]
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K).reshape(32, cols)).to(torch.bfloat16)
    assert dense_weights_kept(model) and linear.dense_weight is not None
    x = torch.randn(DENSE_ROWS, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    # the copy's GEMM on bfloat16 x: no int8 rounding of x, so far closer than the integer kernel gets
    reference = x.float() @ expected.float().T
    assert (linear(x).float() - reference).abs().max() <= 0.005 * reference.abs().max()
    assert (linear.forward_rows(x).float() - reference).abs().max() > 0.005 * reference.abs().max()
    assert keep_dense_weights(model, "off", torch.bfloat16).startswith("off") and linear.dense_weight is None


def test_the_modes_name_their_types():
    """auto: every K-quant and IQ4 type (group_quant has no layout for Q2_K, Q3_K and the IQ4s), not the
    other 32-value types, so a Q4_1 + Q8_0 file (the default model) keeps its float activations."""
    from worker.linears.ggml_blocks import block_types
    from worker.options import CPU_BLOCK_KERNEL_MODES, WorkerOptions

    assert block_types("auto") == {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
    assert block_types("all") == set(BLOCK_TYPES) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
                                                      "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}
    assert block_types("off") == set() and {block_types(mode) is not None for mode in CPU_BLOCK_KERNEL_MODES} == {True}
    assert WorkerOptions().cpu_block_kernels == "auto"
    with pytest.raises(ValueError, match="cpu_block_kernels='some' is not one of"):
        WorkerOptions(cpu_block_kernels="some")


def test_the_worker_log_names_the_kernel_this_cpu_runs():
    from worker.linears.ggml_blocks import describe_block_kernels

    model = torch.nn.Sequential(GGMLBlocksLinear(GGMLBlocksWeight.from_blocks("Q4_K", random_blocks("Q4_K", 16, 256), 16, 256)))
    text = describe_block_kernels(model)
    flags = cpu_flags()
    if amx_usable():
        assert "avx512_vnni integer dot products (AMX-INT8 tiles for Q4_K, Q5_K, Q6_K from 6 rows)" in text
        assert "up to 64 rows" in text
    elif WIDE_FLAGS <= flags:
        assert "avx512_vnni integer dot products on" in text and "up to 24 rows" in text
    else:
        assert "avx2 integer dot products (an AVX2 GEMM for Q4_K, Q5_K, Q6_K, 1-512 rows) on" in text
        assert "up to 512 rows" in text
    assert describe_block_kernels(torch.nn.Sequential(torch.nn.Linear(2, 2))) is None
