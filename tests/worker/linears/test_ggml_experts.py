"""A mixture of experts' experts on GGUF blocks (worker/csrc/ggml_blocks_experts.cpp, worker.linears.ggml_experts)
against the float experts of worker.model.moe, the reference.

Three oracles. The float reference (run_experts over gguf-py's dequantized weights) differs by the activations'
int8 rounding (relative 3e-2 here: two roundings, gate/up's and down's; 0.3-1.9% measured); the same reference
with x and the hidden activations rounded as the kernels round them (q8_K), in float64, is within 1e-4. Per expert, the dense block op over that
expert's rows alone (ggml_blocks_linear, same instruction set) must give the same bits: the experts' op only
schedules the dense kernels, and an expert's rows do not depend on the other experts'. Layouts: 1, 2, 5, 6, 16 and
64 tokens (top 2 of 8 experts, expert 3 never chosen), and 16 tokens all to one expert (top 1): the counts cross
the tiles' 6-row threshold both ways.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from tests.worker.linears.test_ggml_blocks import available_paths, q8k_rounded, random_blocks
from worker.linears.ggml_blocks import BLOCK_TYPES, KERNEL_PATHS, BlockPart
from worker.linears.ggml_experts import ExpertBlocksWeight, GGMLBlocksExperts
from worker.model.moe import run_experts, run_grouped
from worker.native_ops import cpu_ops_available

pytestmark = pytest.mark.skipif(not cpu_ops_available(), reason="the compiled CPU ops are not built")

EXPERTS, HIDDEN, INTER = 8, 512, 256
LAYOUTS = {"1 token": (1, 2), "2 tokens": (2, 2), "5 tokens": (5, 2), "6 tokens": (6, 2), "16 tokens": (16, 2),
           "64 tokens": (64, 2), "16 tokens to one expert": (16, 1)}
# (gate, up, down) types: one type throughout, and Q4_K_M's gate/up Q4_K with down Q6_K
TYPE_MIXES = [("Q4_K",) * 3, ("Q5_K",) * 3, ("Q6_K",) * 3, ("Q8_0",) * 3, ("Q4_0",) * 3, ("Q4_K", "Q4_K", "Q6_K")]


def make_experts(types: tuple[str, str, str], seed: int = 0) -> GGMLBlocksExperts:
    gate, up, down = (random_blocks(type_name, EXPERTS * rows, cols, seed + i)
                      for i, (type_name, rows, cols) in enumerate(zip(types, (INTER, INTER, HIDDEN), (HIDDEN, HIDDEN, INTER))))
    gate_up = ExpertBlocksWeight.from_blocks([(types[0], gate), (types[1], up)], EXPERTS, HIDDEN)
    return GGMLBlocksExperts(gate_up, ExpertBlocksWeight.from_blocks([(types[2], down)], EXPERTS, INTER), "silu")


def routing(layout: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], routing weights [T, K], expert ids [T, K]: expert 3 never chosen, or every token to expert 5."""
    tokens, top_k = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    if top_k == 1:
        top_experts = torch.full((tokens, 1), 5)
    else:
        chosen = torch.stack([torch.randperm(EXPERTS - 1, generator=generator)[:top_k] for _ in range(tokens)])
        top_experts = chosen + (chosen >= 3).long()  # skip expert 3
    top_weights = torch.softmax(torch.randn(tokens, top_k, generator=generator), dim=-1)
    return x, top_weights, top_experts


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("types", TYPE_MIXES, ids="-".join)
def test_block_experts_match_the_float_reference(types, layout):
    experts = make_experts(types)
    x, top_weights, top_experts = routing(layout)
    gate_up, down = (weight.dequantize() for weight in experts.expert_blocks)
    reference = run_experts(x, top_weights, top_experts, gate_up, down)
    got = run_grouped(x, top_weights, top_experts, EXPERTS, experts)
    assert got.shape == reference.shape and got.dtype == torch.float32
    assert (got - reference).norm() <= 3e-2 * reference.norm(), (types, layout)
    rounded = run_grouped(x.double(), top_weights.double(), top_experts, EXPERTS,
                          lambda rows, counts: expert_matmuls_rounded(rows, counts, gate_up.double(), down.double()))
    assert (got.double() - rounded).norm() <= 1e-4 * rounded.norm(), (types, layout)
    assert not (top_experts == 3).any()  # an expert with zero tokens in every layout


def q8k(values: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(q8k_rounded(values.float().numpy()))


def expert_matmuls_rounded(rows, counts, gate_up, down):
    """worker.model.moe.expert_matmuls with each matmul's input rounded to q8_K first, as the kernels round it."""
    out, start = torch.empty_like(rows), 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        span = slice(start, start + count)
        gate, up = (q8k(rows[span]) @ gate_up[expert].T).chunk(2, dim=-1)
        out[span] = q8k(F.silu(gate.float()).double() * up) @ down[expert].T
        start += count
    return out


def dense_per_expert(experts: GGMLBlocksExperts, rows: torch.Tensor, counts: list[int], path: int) -> torch.Tensor:
    """Each expert's rows through the dense block op alone, on one instruction set."""
    gate_up, down = experts.expert_blocks
    out, start = torch.empty_like(rows), 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        span = slice(start, start + count)
        parts = [part.blocks[expert] for part in gate_up.parts]
        gate, up = torch.ops.tokenmill.ggml_blocks_linear(rows[span], parts, [BLOCK_TYPES[p.type_name] for p in gate_up.parts],
                                                          path, None).chunk(2, dim=-1)
        out[span] = torch.ops.tokenmill.ggml_blocks_linear(F.silu(gate) * up, [down.parts[0].blocks[expert]],
                                                           [BLOCK_TYPES[down.parts[0].type_name]], path, None)
        start += count
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", [pytest.param("auto", id="auto"), *available_paths()])
@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q8_0", "Q4_0")], ids="-".join)
def test_each_expert_is_the_dense_block_op_over_its_rows_bit_for_bit(types, path, dtype):
    experts = make_experts(types, seed=3)
    experts.kernel_path = KERNEL_PATHS[path]
    for layout in LAYOUTS:
        x, _, top_experts = routing(layout, seed=1)
        order = torch.argsort(top_experts.reshape(-1), stable=True)
        rows = x.to(dtype).index_select(0, order // top_experts.shape[1])
        counts = torch.bincount(top_experts.reshape(-1), minlength=EXPERTS)
        got = experts(rows, counts)
        assert got.dtype == dtype
        assert torch.equal(got, dense_per_expert(experts, rows, counts.tolist(), KERNEL_PATHS[path])), (layout, path)


@pytest.mark.parametrize("weights_dtype", [torch.float32, "x's"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", [pytest.param("auto", id="auto"), *available_paths()])
def test_one_native_call_a_layer_is_run_grouped_around_the_experts_bit_for_bit(path, dtype, weights_dtype):
    """routed() (torch.ops.tokenmill.ggml_blocks_moe: grouping, both projections, the activation, the weighted sum)
    against run_grouped's torch calls around forward(), at every routing layout, 3 of them at once: the same bits."""
    experts = make_experts(("Q4_K", "Q4_K", "Q6_K"), seed=5)
    experts.kernel_path = KERNEL_PATHS[path]
    for layout in LAYOUTS:
        x, top_weights, top_experts = routing(layout, seed=2)
        x, top_weights = x.to(dtype), top_weights.to(dtype if weights_dtype == "x's" else weights_dtype)
        got = run_grouped(x, top_weights, top_experts, EXPERTS, experts)  # routed(): experts has the method
        composed = run_grouped(x, top_weights, top_experts, EXPERTS, experts.forward)  # a bound method has none
        assert got.dtype == dtype and torch.equal(got, composed), (layout, path)
    assert experts.routed(x[:0], top_weights[:0], top_experts[:0]).shape == (0, HIDDEN)
    halves = torch.full((2, 2), 0.5)
    with pytest.raises(RuntimeError, match=f"token 1 routed to expert {EXPERTS} of {EXPERTS}"):
        experts.routed(x[:2], halves, torch.tensor([[0, 1], [2, EXPERTS]]))
    with pytest.raises(RuntimeError, match=r"must both be \[2 tokens, k\]"):
        experts.routed(x[:2], halves[:1], torch.tensor([[0, 1], [2, 3]]))


def test_no_rows_and_bad_offsets():
    experts = make_experts(("Q4_K",) * 3)
    assert experts(torch.empty(0, HIDDEN), torch.zeros(EXPERTS, dtype=torch.long)).shape == (0, HIDDEN)
    gate_up = [part.blocks for part in experts.expert_blocks[0].parts]
    types = [BLOCK_TYPES["Q4_K"]] * 2
    with pytest.raises(RuntimeError, match="offsets must run from 0 to 4"):
        torch.ops.tokenmill.ggml_blocks_experts(torch.randn(4, HIDDEN), torch.tensor([0] * 8 + [3]), gate_up, types, 0)
    with pytest.raises(RuntimeError, match="offsets decrease at expert 1"):
        torch.ops.tokenmill.ggml_blocks_experts(torch.randn(4, HIDDEN), torch.tensor([0, 3, 1, 4, 4, 4, 4, 4, 4]),
                                                gate_up, types, 0)
    with pytest.raises(RuntimeError, match="must be contiguous uint8"):
        torch.ops.tokenmill.ggml_blocks_experts(torch.randn(4, HIDDEN), torch.tensor([0, 4] + [4] * 7),
                                                [gate_up[0][:, :, :-1]], types[:1], 0)
    with pytest.raises(ValueError, match="disagree on the number of experts"):
        ExpertBlocksWeight((BlockPart("Q4_K", torch.zeros(2, 4, 144, dtype=torch.uint8)),
                            BlockPart("Q4_K", torch.zeros(3, 4, 144, dtype=torch.uint8))), 256)
    with pytest.raises(ValueError, match="does not match down"):
        GGMLBlocksExperts(experts.expert_blocks[0], experts.expert_blocks[0], "silu")


def test_from_blocks_maps_the_file_without_a_copy():
    raw = np.ascontiguousarray(random_blocks("Q6_K", EXPERTS * 32, HIDDEN))
    weight = ExpertBlocksWeight.from_blocks([("Q6_K", raw)], EXPERTS, HIDDEN)
    assert weight.parts[0].blocks.data_ptr() == raw.ctypes.data
    assert (weight.num_experts, weight.out_features, weight.in_features, weight.nbytes) == (EXPERTS, 32, HIDDEN, raw.nbytes)
