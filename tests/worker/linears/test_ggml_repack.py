"""K-quant block weights repacked at load for the AVX2 GEMM (worker/csrc/ggml_blocks_repack.cpp,
worker.linears.ggml_repack) against gguf-py and against the GEMM on the file's own blocks.

The repacked GEMM (forced: path 4 runs on any x86-64 CPU with AVX2) against gguf-py's dequantize and a float64
matmul of x rounded as the kernel's q8_K, rows 1, 3, 5, 16, 64 and 512; bit for bit today's GEMM on the file's
blocks (the same integer sums and float steps), each row alone; the layout's round trip; and the loader's swap:
a tied embedding follows its lm_head, the file's pages of a repacked tensor leave the process.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from tests.worker.linears.test_ggml_blocks import ROWS, q8k_rounded, random_blocks
from worker.linears.ggml_blocks import (BLOCK_TYPES, KERNEL_PATHS, REPACKED, BlockPart, GGMLBlocksEmbedding,
                                        GGMLBlocksLinear, GGMLBlocksWeight, describe_block_kernels, dot_rows,
                                        mapped_weight_bytes)
from worker.native_ops import cpu_flags, cpu_ops_available

pytestmark = [
    pytest.mark.skipif(not cpu_ops_available(), reason="the compiled CPU ops are not built"),
    pytest.mark.skipif(not {"avx2", "fma", "f16c"} <= cpu_flags(),
                       reason="the repacked GEMM is AVX2 code: this CPU lacks avx2, fma or f16c"),
]

K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]
GEMM = KERNEL_PATHS["avx2_gemm"]


def repacked(raw: np.ndarray, type_name: str, cols: int) -> torch.Tensor:
    return torch.ops.tokenmill.ggml_blocks_repack(torch.from_numpy(raw), BLOCK_TYPES[type_name], cols)


@pytest.mark.parametrize("type_name", K_QUANTS)
def test_the_repacked_gemm_equals_gguf_dequantize_then_matmul(type_name):
    cols, out_rows = 1536, 40
    raw = random_blocks(type_name, out_rows, cols)
    weight = dequantize(raw, GGMLQuantizationType[type_name]).reshape(out_rows, cols).astype(np.float64)
    packed = repacked(raw, type_name, cols)
    rng = np.random.default_rng(1)
    for rows in ROWS:
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        got = torch.ops.tokenmill.ggml_blocks_linear(torch.from_numpy(x), [packed], [BLOCK_TYPES[type_name] + REPACKED],
                                                     GEMM).numpy()
        exact = q8k_rounded(x) @ weight.T
        assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max(), (type_name, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", K_QUANTS)
def test_the_repacked_gemm_gives_todays_gemm_bits(type_name, dtype):
    """At every row count (one tile of x or fewer reads the repacked registers directly, more decode them once
    into the GEMM's tile, two groups of 8 weight rows at a time where two remain), with a bias, for x in float32
    and bfloat16. 7 groups: three pairs and a group alone."""
    cols, out_rows = 768, 56
    raw = random_blocks(type_name, out_rows, cols, seed=2)
    packed, blocks = repacked(raw, type_name, cols), torch.from_numpy(raw)
    bias = torch.randn(out_rows)
    for rows in ROWS:
        x = torch.randn(rows, cols).to(dtype)
        today = torch.ops.tokenmill.ggml_blocks_linear(x, [blocks], [BLOCK_TYPES[type_name]], GEMM, bias)
        got = torch.ops.tokenmill.ggml_blocks_linear(x, [packed], [BLOCK_TYPES[type_name] + REPACKED], GEMM, bias)
        assert torch.equal(got, today), (type_name, rows, dtype)


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_share_chunks_of_columns_with_one_threads_bits(threads):
    """The threads take chunks of 64 columns (shared_chunks: each its own share first, then what is left of the
    others'), over parts whose boundaries fall inside a chunk and a last chunk that is short: the bits of one
    thread, which are the file-layout GEMM's."""
    cols, parts = 512, [("Q4_K", 136), ("Q6_K", 48), ("Q5_K", 40)]  # 224 columns: chunks 0-63 .. 192-223
    raws = [random_blocks(t, n, cols, seed=10 + i) for i, (t, n) in enumerate(parts)]
    packed = [repacked(r, t, cols) for r, (t, _) in zip(raws, parts)]
    types = [BLOCK_TYPES[t] for t, _ in parts]
    before = torch.get_num_threads()
    try:
        for rows in (1, 5, 64):
            x = torch.randn(rows, cols)
            torch.set_num_threads(1)
            one = torch.ops.tokenmill.ggml_blocks_linear(x, packed, [t + REPACKED for t in types], GEMM)
            today = torch.ops.tokenmill.ggml_blocks_linear(x, [torch.from_numpy(r) for r in raws], types, GEMM)
            torch.set_num_threads(threads)
            many = torch.ops.tokenmill.ggml_blocks_linear(x, packed, [t + REPACKED for t in types], GEMM)
            assert torch.equal(many, one) and torch.equal(one, today), (threads, rows)
    finally:
        torch.set_num_threads(before)


def test_a_fused_projection_mixes_repacked_and_file_parts():
    """Q4_K_M's q/k/v with a Q8_0 part beside (which stays in the file's layout): the bits of today's GEMM, and
    each row's bits alone equal its bits among others."""
    cols = 512
    parts = [("Q4_K", 32), ("Q6_K", 16), ("Q5_K", 8), ("Q8_0", 13)]
    raws = [random_blocks(t, n, cols, seed=i) for i, (t, n) in enumerate(parts)]
    file_parts = [torch.from_numpy(r) for r in raws]
    mixed = [repacked(r, t, cols) if t != "Q8_0" else torch.from_numpy(r) for r, (t, _) in zip(raws, parts)]
    mixed_types = [BLOCK_TYPES[t] + (REPACKED if t != "Q8_0" else 0) for t, _ in parts]
    x = torch.randn(11, cols)
    today = torch.ops.tokenmill.ggml_blocks_linear(x, file_parts, [BLOCK_TYPES[t] for t, _ in parts], GEMM)
    got = torch.ops.tokenmill.ggml_blocks_linear(x, mixed, mixed_types, GEMM)
    assert torch.equal(got, today)
    for row in (0, 4, 9, 10):
        alone = torch.ops.tokenmill.ggml_blocks_linear(x[row:row + 1], mixed, mixed_types, GEMM)
        assert torch.equal(alone[0], got[row]), row


@pytest.mark.parametrize("type_name", K_QUANTS)
def test_the_layout_round_trips_and_dequantizes_as_gguf_py(type_name):
    cols = 512
    raw = random_blocks(type_name, 16, cols, seed=3)
    packed = repacked(raw, type_name, cols)
    assert packed.numel() <= raw.nbytes * 1.03  # about the file's size
    unpacked = torch.ops.tokenmill.ggml_blocks_unpack(packed, BLOCK_TYPES[type_name] + REPACKED, cols)
    assert torch.equal(unpacked, torch.from_numpy(raw))
    expected = dequantize(raw, GGMLQuantizationType[type_name]).reshape(16, cols)
    weight = GGMLBlocksWeight((BlockPart(type_name, packed, repacked=True),), cols)
    assert np.array_equal(weight.dequantize().numpy(), expected)
    assert np.array_equal(weight.dequantize(torch.tensor([9, 0, 15])).numpy(), expected[[9, 0, 15]])
    bf16 = torch.ops.tokenmill.ggml_blocks_dequantize_bf16(packed, BLOCK_TYPES[type_name] + REPACKED, cols, 3, 11)
    assert torch.equal(bf16, torch.from_numpy(expected[3:11]).to(torch.bfloat16))


def test_bad_repacked_inputs_name_what_is_wrong():
    raw = torch.from_numpy(random_blocks("Q4_K", 12, 256))
    with pytest.raises(RuntimeError, match=r"N a multiple of 8, got \[12, 144\]"):
        torch.ops.tokenmill.ggml_blocks_repack(raw, BLOCK_TYPES["Q4_K"], 256)
    with pytest.raises(RuntimeError, match="GGML type 8 has no repacked layout"):
        torch.ops.tokenmill.ggml_blocks_repack(torch.from_numpy(random_blocks("Q8_0", 8, 256)), BLOCK_TYPES["Q8_0"], 256)
    packed = repacked(random_blocks("Q4_K", 8, 256), "Q4_K", 256)
    with pytest.raises(RuntimeError, match="repacked parts run on the AVX2 GEMM only .* not on path 1"):
        torch.ops.tokenmill.ggml_blocks_linear(torch.randn(1, 256), [packed], [BLOCK_TYPES["Q4_K"] + REPACKED],
                                               KERNEL_PATHS["avx2"])
    with pytest.raises(ValueError, match="a repacked Q4_K part of 4 rows"):
        GGMLBlocksWeight((BlockPart("Q4_K", packed[:4], repacked=True),), 256)


class TiedModel(nn.Module):
    """An embedding and an lm_head on one GGMLBlocksWeight (a tied model's), beside an unrepackable linear."""

    def __init__(self, weight: GGMLBlocksWeight, odd: GGMLBlocksWeight) -> None:
        super().__init__()
        self.embed_tokens = GGMLBlocksEmbedding(weight, torch.float32)
        self.lm_head = GGMLBlocksLinear(weight)
        self.odd = GGMLBlocksLinear(odd)  # 12 rows: not groups of 8


def mapped_file_weight(tmp_path: Path, type_name: str, rows: int, cols: int) -> GGMLBlocksWeight:
    raw = random_blocks(type_name, rows, cols, seed=6)
    path = tmp_path / f"{type_name}.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=raw.shape)
    return GGMLBlocksWeight.from_blocks(type_name, mapped, rows, cols)


def rss_of(path: Path) -> int:
    """This process's resident kB of its mappings of path (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_repack_linears_swaps_the_tied_pair_and_gives_back_the_file_pages(tmp_path, monkeypatch, caplog):
    from worker.linears import ggml_repack

    monkeypatch.setattr(ggml_repack, "repacks_here", lambda: True)  # what auto does on an AVX2-only CPU
    cols = 1024
    weight = mapped_file_weight(tmp_path, "Q6_K", 256, cols)
    odd = GGMLBlocksWeight.from_blocks("Q4_K", random_blocks("Q4_K", 12, cols), 12, cols)
    model = TiedModel(weight, odd)
    model.lm_head.kernel_path = GEMM  # auto's on an AVX2-only CPU; forced, the test runs on any AVX2 CPU
    x = torch.randn(3, cols)
    many = torch.randn(dot_rows() + 1, cols)
    # the strips through torch: a repacked weight's many-row steps (the AMX-BF16 tiles read the file's blocks only)
    before, strips_before = model.lm_head(x), model.lm_head.forward_dequantized_strips(many)
    embedded_before = model.embed_tokens(torch.tensor([5, 200]))
    assert rss_of(tmp_path / "Q6_K.bin") > 0
    with caplog.at_level(logging.INFO, logger="worker.linears.ggml_repack"):
        assert ggml_repack.repack_linears(model) == 1
    assert model.lm_head.repacked and not model.odd.repacked
    assert model.embed_tokens.weight_blocks is model.lm_head.weight_blocks
    assert rss_of(tmp_path / "Q6_K.bin") == 0  # the file's pages left this process
    assert mapped_weight_bytes(model) == odd.nbytes  # the repacked copy is process memory, not page cache
    model.lm_head.kernel_path = GEMM
    assert torch.equal(model.lm_head(x), before)
    assert torch.equal(model.lm_head.forward_rows(x), before)  # the deterministic entry: the GEMM, each row alone
    assert torch.equal(model.lm_head(many), strips_before)  # a long prefill's strips, unpacked row by row
    assert torch.equal(model.embed_tokens(torch.tensor([5, 200])), embedded_before)
    assert rss_of(tmp_path / "Q6_K.bin") == 0  # and nothing read the file's pages again
    assert "repacked 1 K-quant block weights" in caplog.text
    assert "2 linears on GGML blocks, 1 of them repacked at load" in describe_block_kernels(model)


def test_repack_linears_does_nothing_where_auto_is_not_the_avx2_gemm(monkeypatch):
    from worker.linears import ggml_repack

    monkeypatch.setattr(ggml_repack, "repacks_here", lambda: False)
    weight = GGMLBlocksWeight.from_blocks("Q4_K", random_blocks("Q4_K", 16, 256), 16, 256)
    model = TiedModel(weight, weight)
    assert ggml_repack.repack_linears(model) == 0
    assert not model.lm_head.repacked


class MoeLayer(nn.Module):
    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q8_0", "Q6_K")], ids="-".join)
def test_repacked_experts_give_the_gemms_bits_and_keep_other_types_as_stored(monkeypatch, types):
    """A mixture of experts' stacked blocks repack as one tensor of every expert's rows: each expert's rows through
    the repacked GEMM give the bits of the GEMM on the file's blocks, at every routing layout (one token to many,
    an expert with none), in float32 and bfloat16; a Q8_0 part stays in the file's layout."""
    from tests.worker.linears.test_ggml_experts import EXPERTS, LAYOUTS, make_experts, routing
    from worker.linears import ggml_repack
    from worker.linears.ggml_experts import describe_experts

    monkeypatch.setattr(ggml_repack, "repacks_here", lambda: True)  # what auto does on an AVX2-only CPU
    layer = MoeLayer(make_experts(types, seed=4))
    file_layout = layer.experts
    file_layout.kernel_path = GEMM  # the GEMM at every row count, forced (auto's vector kernel below its rows)
    inputs = []
    for layout in LAYOUTS:
        x, _, top_experts = routing(layout, seed=2)
        order = torch.argsort(top_experts.reshape(-1), stable=True)
        counts = torch.bincount(top_experts.reshape(-1), minlength=EXPERTS)
        for dtype in (torch.float32, torch.bfloat16):
            rows = x.to(dtype).index_select(0, order // top_experts.shape[1])
            inputs.append((layout, rows, counts, file_layout(rows, counts)))
    assert ggml_repack.repack_linears(layer) == 2  # gate/up and down
    experts = layer.experts
    assert experts is not file_layout and experts.hidden_act == "silu"
    assert [[part.repacked for part in weight.parts] for weight in experts.expert_blocks] == [
        [type_name != "Q8_0" for type_name in types[:2]], [True]]
    for repacked_weight, file_weight in zip(experts.expert_blocks, file_layout.expert_blocks):
        assert torch.equal(repacked_weight.dequantize(), file_weight.dequantize())
    experts.kernel_path = GEMM
    for layout, rows, counts, expected in inputs:
        assert torch.equal(experts(rows, counts), expected), (layout, rows.dtype)
    assert "K-quants repacked at load" in describe_experts(layer) and "the AVX2 GEMM" in describe_experts(layer)
    experts.kernel_path = KERNEL_PATHS["avx2"]
    with pytest.raises(RuntimeError, match="repacked parts run on the AVX2 GEMM only"):
        experts(*inputs[0][1:3])
