"""Batch invariance of every kernel --deterministic runs on the Triton path (worker.paths.triton.batch_invariant):
a row's output is the same bits computed alone, as the middle row of 3, and at another place among 17 rows
(and 40 for the matmuls: a second row tile). Under the interpreter on CPU; on CUDA in the device script,
where it is the check that matters (tile shapes and instruction choices are real there).

fixed_tile_matmul is also checked against a torch reference, as every kernel is (tolerances.py)."""
from __future__ import annotations

from typing import Callable, Sequence

import pytest
import torch
import torch.nn.functional as F

from tests.worker.kernels.paged_reference import DEVICE, make_paged_cache, random_query, reference_attention
from tests.worker.kernels.tolerances import assert_close
from worker.kernels.activation import silu_and_mul
from worker.kernels.fixed_tile_matmul import FIXED_TILE, fixed_tile_matmul
from worker.kernels.group_quant_matmul import group_quant_matmul, group_quant_matmul_torch
from worker.kernels.int8_matmul import int8_weight_matmul, int8_weight_matmul_torch, quantize_int8_weight
from worker.kernels.paged_decode_attention import paged_decode_attention
from worker.kernels.rms_norm import fused_add_rms_norm, rms_norm
from worker.kernels.rotary import apply_rotary
from worker.kernels.sampling import sample_tokens
from worker.linears.group_quant import quantize_weight
from worker.model.llama import rope_cos_sin
from worker.paths.triton.batch_invariant import GROUP_QUANT_TILE

NUM_ROWS = 17
TARGETS = (0, 6, 16)  # the row checked: first, middle, last of the 17


def _batches(target: int, num_rows: int) -> list[tuple[list[int], int]]:
    """(row indices, where target sits among them): alone, the middle of 3, and all rows rotated so that
    target moves to another place (so its neighbours differ too)."""
    others = [row for row in range(num_rows) if row != target]
    rotated = [(target + 5 + i) % num_rows for i in range(num_rows)]
    return [([target], 0), ([others[3], target, others[-2]], 1), (rotated, rotated.index(target))]


def assert_rows_invariant(kernel: Callable[[list[int]], torch.Tensor | Sequence[torch.Tensor]],
                          num_rows: int = NUM_ROWS) -> None:
    """kernel(rows) runs the kernel on those rows of its inputs (in that order) and returns its outputs,
    each indexed by row first."""
    for target in TARGETS:
        seen = []
        for rows, place in _batches(target, num_rows):
            outputs = kernel(rows)
            outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
            seen.append([out[place] for out in outputs])
        for other in seen[1:]:
            for first, again in zip(seen[0], other):
                assert torch.equal(first, again), f"row {target}: alone vs batched differ"


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


MATMUL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", MATMUL_DTYPES)
@pytest.mark.parametrize("num_rows", [1, 17, 40])
def test_fixed_tile_matmul_matches_the_torch_reference_on_strided_rows(dtype, num_rows):
    x = _randn(num_rows, 2 * 96, seed=num_rows, dtype=dtype)[:, :96]  # N = 40, K = 96: partial tiles both ways
    weight, bias = _randn(40, 96, seed=1, dtype=dtype), _randn(40, seed=2, dtype=dtype)
    out = fixed_tile_matmul(x, weight, bias)
    assert out.dtype == dtype and out.shape == (num_rows, 40)
    assert_close(out, F.linear(x.float(), weight.float(), bias.float()), dtype)
    qweight, scales = quantize_int8_weight(_randn(40, 96, seed=3))
    assert_close(fixed_tile_matmul(x, qweight, scales=scales), int8_weight_matmul_torch(x.float(), qweight, scales), dtype)


@pytest.mark.parametrize("dtype", MATMUL_DTYPES)
def test_fixed_tile_matmul_gives_a_row_the_same_bits_in_any_batch(dtype):
    num_rows = FIXED_TILE[0] + 8  # a second row tile
    x = _randn(num_rows, 96, seed=4, dtype=dtype)
    weight, bias = _randn(40, 96, seed=5, dtype=dtype), _randn(40, seed=6, dtype=dtype)
    qweight, scales = quantize_int8_weight(_randn(40, 96, seed=7))
    assert_rows_invariant(lambda rows: fixed_tile_matmul(x[rows], weight, bias), num_rows)
    assert_rows_invariant(lambda rows: fixed_tile_matmul(x[rows], qweight, scales=scales), num_rows)


def test_the_default_matmul_wrappers_give_a_row_other_bits_at_another_row_count():
    """Why the mode needs its own tiles: int8_weight_matmul and group_quant_matmul pick theirs (and the
    group-quantized GEMV kernel up to 8 rows) by row count, so one row alone and among 40 sums in another order.
    (Under the interpreter both differ; on CUDA a float32 dot is a chain of FMAs in K order whatever BLOCK_K, so
    the int8 kernel's rows may agree there: the GEMV kernel's per-group sums never equal the tiled kernel's.)"""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(40, 256, generator=generator).to(DEVICE)
    qweight, scales = quantize_int8_weight(torch.randn(40, 256, generator=generator).to(DEVICE))
    int8_same = torch.equal(int8_weight_matmul(x[:1], qweight, scales), int8_weight_matmul(x, qweight, scales)[:1])
    weight = quantize_weight(torch.randn(40, 256, generator=generator), 4, 32)
    codes, gq_scales, mins = (tensor.to(DEVICE) for tensor in (weight.codes, weight.scales, weight.mins))
    assert not torch.equal(group_quant_matmul(x[:1], codes, gq_scales, mins, 4, 32),
                           group_quant_matmul(x, codes, gq_scales, mins, 4, 32)[:1])
    assert DEVICE == "cuda" or not int8_same


@pytest.mark.parametrize("bits, group_size", [(4, 32), (8, 32), (8, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_quant_matmul_in_the_fixed_tile_gives_a_row_the_same_bits_in_any_batch(bits, group_size, dtype):
    weight = quantize_weight(torch.randn(40, 160, generator=torch.Generator().manual_seed(8)), bits, group_size)
    codes, scales, mins = (tensor.to(DEVICE) for tensor in (weight.codes, weight.scales, weight.mins))
    num_rows = GROUP_QUANT_TILE[0] + 8
    x = _randn(num_rows, 160, seed=9, dtype=dtype)

    def run(rows: list[int]) -> torch.Tensor:
        return group_quant_matmul(x[rows], codes, scales, mins, bits, group_size, kernel="dequant",
                                  dequant_config=GROUP_QUANT_TILE)

    assert_rows_invariant(run, num_rows)
    # the dequantizing kernel rounds each weight to x's dtype once (test_group_quant_matmul checks that
    # rounding closely): here only that the fixed tile computes the product
    expected = group_quant_matmul_torch(x.float(), codes, scales, mins, bits, group_size)
    relative = ((run(list(range(num_rows))).float() - expected).norm() / expected.norm()).item()
    assert relative < {torch.float32: 1e-6, torch.bfloat16: 1e-2}[dtype]


@pytest.mark.parametrize("dtype, window", [(torch.float32, None), (torch.bfloat16, None), (torch.float16, 20)])
def test_decode_attention_in_one_split_gives_a_token_the_same_bits_in_any_batch(dtype, window):
    """Rows are tokens of a few requests at every context length, as token_host_metadata lays out a
    prefill chunk: token r of a request reads the request's pages up to its own position."""
    generator = torch.Generator().manual_seed(10)
    request_lens = [70, 9, 33]  # 70 > BLOCK_N: several key steps
    cache = make_paged_cache(request_lens, 16, 2, 32, dtype, generator)
    rows = [(request, length - offset) for request, length in enumerate(request_lens) for offset in (0, 2, 5, 8)]
    rows = rows[:NUM_ROWS] + [(0, 1)] * (NUM_ROWS - len(rows))  # 17 rows; one at context 1
    tables = cache.block_tables[[request for request, _ in rows]]
    context_lens = torch.tensor([length for _, length in rows], dtype=torch.int32, device=DEVICE)
    query = random_query(NUM_ROWS, 6, 32, dtype, generator)

    def run(picked: list[int]) -> torch.Tensor:
        return paged_decode_attention(query[picked], cache.key_cache, cache.value_cache, tables[picked],
                                      context_lens[picked], 0.2, num_splits=1, window=window)

    assert_rows_invariant(run)
    expected = torch.cat([reference_attention(query[[row]], _one_request(cache, tables[row], length), [1], 0.2, window)
                          for row, (_, length) in enumerate(rows)])
    assert_close(run(list(range(NUM_ROWS))), expected, dtype)


def _one_request(cache, table: torch.Tensor, context_len: int):
    return type(cache)(cache.key_cache, cache.value_cache, table[None], torch.tensor([context_len], device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_rotary_and_silu_give_a_row_the_same_bits_in_any_batch(dtype):
    x, residual = _randn(NUM_ROWS, 96, seed=11, dtype=dtype), _randn(NUM_ROWS, 96, seed=12, dtype=dtype)
    weight = _randn(96, seed=13, dtype=dtype)
    assert_rows_invariant(lambda rows: rms_norm(x[rows], weight, 1e-5))
    assert_rows_invariant(lambda rows: fused_add_rms_norm(x[rows], residual[rows], weight, 1e-5))
    # the per-head q/k norm of the Triton forward: [T * heads, D] rows
    heads = _randn(NUM_ROWS, 4, 16, seed=14, dtype=dtype)
    assert_rows_invariant(lambda rows: rms_norm(heads[rows].reshape(-1, 16), weight[:16], 1e-5).view(len(rows), 4, 16))
    query, key = _randn(NUM_ROWS, 4, 16, seed=15, dtype=dtype), _randn(NUM_ROWS, 2, 16, seed=16, dtype=dtype)
    cos, sin = rope_cos_sin(torch.arange(NUM_ROWS, device=DEVICE) * 7, 16, 10000.0, dtype)
    assert_rows_invariant(lambda rows: apply_rotary(query[rows].clone(), key[rows].clone(), cos[rows], sin[rows]))
    gate_up = _randn(NUM_ROWS, 2 * 96, seed=17, dtype=dtype)
    assert_rows_invariant(lambda rows: silu_and_mul(*gate_up[rows].chunk(2, dim=-1)))


def test_sampling_gives_a_row_the_same_token_in_any_batch():
    """Greedy rows, and seeded rows through the filters (the torch sort / softmax / cumsum of the thresholds)."""
    logits = _randn(NUM_ROWS, 300, seed=18) * 3
    temperature = torch.tensor([0.0 if row % 3 == 0 else 0.8 for row in range(NUM_ROWS)], device=DEVICE)
    top_k = torch.tensor([0 if row % 2 else 20 for row in range(NUM_ROWS)], device=DEVICE)
    top_p = torch.tensor([0.9 if row % 4 else 1.0 for row in range(NUM_ROWS)], device=DEVICE)
    seeds = torch.arange(NUM_ROWS, dtype=torch.int64, device=DEVICE) * 1000 + 7

    def run(rows: list[int]) -> torch.Tensor:
        return sample_tokens(logits[rows], temperature[rows], top_k[rows], top_p[rows], seeds[rows])

    assert_rows_invariant(run)
    assert_rows_invariant(lambda rows: logits[rows].argmax(dim=-1))
