"""Fused mixture-of-experts feed-forward: every expert's gate/up in one grouped-GEMM launch, SiLU·mul, every
expert's down in a second launch with the routing weight applied, then each token's k outputs summed (vLLM's and
SGLang's fused_moe design: sorted token-expert pairs padded so that one BLOCK_M block holds one expert's pairs).

A step's T tokens choose K experts each: pair p = t * K + k is token t's k-th choice (top_experts.reshape(-1)).
align_pairs sorts the pairs by expert (stable: token order within an expert) and pads each expert's run up to a
multiple of BLOCK_M with the sentinel P (= T * K, no pair), so every block of BLOCK_M slots belongs to one expert:

    top_experts [T=3, K=2]:  [[2, 0], [2, 3], [0, 2]]   ->  pairs 0..5 choose experts 2 0 2 3 0 2
    BLOCK_M = 4:
      sorted_pairs   | 1  4  P  P | 0  2  5  P | 3  P  P  P | P  P  P  P |   (padded to the bound, below)
      block_experts  |     0      |     2      |     3      |    -1      |   (expert 1: no pair, no block)

The grid has one row of programs per block; a block of expert -1 (past the last expert's run) returns at once.
The number of blocks is a bound that depends only on (P, E, BLOCK_M), P + min(E, P) * (BLOCK_M - 1) slots, not
on the routing, and the alignment is torch ops without a host sync, so a decode step's MoE layers can sit inside
a CUDA graph (worker.paths.triton.cuda_graphs captures the whole forward).

Each program of _expert_matmul_kernel computes a [BLOCK_M, BLOCK_N] tile of its expert's x_rows @ W_e.T: the
rows gathered by pair (x row p // ROWS_PER_TOKEN: the token's hidden state for gate/up, the pair's own
activation row for down), the weight tile read from W [E, N, K] at its expert, the output scattered to out[p].
An expert with no pairs has no block and so costs nothing; a block's padding slots load zeros and store nothing.

Weights are float, stacked [E, N, K] in x's dtype (worker.model.moe.StackedExperts: gate_up [E, 2I, H] with the
gate rows first, down [E, H, I]), or group-quantized (GroupQuantExperts: each expert's codes / scales / mins in
worker/linears/group_quant.py's layout, the one group_quant_matmul reads, stacked on a leading expert dimension).
A quantized K step dequantizes its [BLOCK_K, BLOCK_N] weight tile (scale * code + min in float32, rounded once to
x's dtype, as group_quant_matmul's "dequant" kernel) and multiplies it in one dot. Sums run in float32; each launch
rounds its output once to x's dtype; the down launch multiplies by the routing weight in float32 before that
rounding, and the k outputs of a token are summed by torch (in float32 for bfloat16 / float16, then rounded once).

gpt-oss's experts add a bias per expert to each launch's output (gate_up_bias [E, 2I], down_bias [E, H]: the block's
expert's row, added in float32 before the routing weight, as GptOssExperts adds it) and take its clamped SwiGLU
between the launches, (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l) (elementwise torch, in
float32, rounded once to x's dtype; no host sync, so a CUDA graph still captures the layer).

fused_moe_torch is the same computation in plain torch, one token at a time (the tests' per-token reference).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from worker.kernels.activation import silu_and_mul
from worker.kernels.checks import FLOAT_DTYPES, check_tensor, output_tensor
from worker.kernels.group_quant_matmul import LAYOUTS, dequantize_group_quant

ACTIVATIONS = ("silu", "gelu_tanh")  # worker.model.moe's: SiLU (every MoE family today) or GeLU-tanh, times up


@dataclass(frozen=True, slots=True)
class GroupQuantExperts:
    """Every expert's weight [N, K] group-quantized as worker.linears.group_quant stores one linear's (4-bit codes
    packed two a byte in groups of 32, low nibbles the group's first 16 columns; or 8-bit codes in groups of 32 or
    16), stacked: W[e, n, k] = scales[e, n, g] * code[e, n, k] + mins[e, n, g], g = k // group_size."""

    codes: torch.Tensor  # uint8 [E, N, K * bits / 8]
    scales: torch.Tensor  # float32 [E, N, K / group_size]
    mins: torch.Tensor  # float32 [E, N, K / group_size]
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K), as a float stacked weight's."""
        num_experts, num_outputs, num_groups = self.scales.shape
        return num_experts, num_outputs, num_groups * self.group_size

    def dequantize(self) -> torch.Tensor:
        """float32 [E, N, K]."""
        return torch.stack([dequantize_group_quant(codes, scales, mins, self.bits, self.group_size)
                            for codes, scales, mins in zip(self.codes, self.scales, self.mins)])


ExpertWeights = torch.Tensor | GroupQuantExperts  # [E, N, K] in x's dtype, or group-quantized


@dataclass(frozen=True, slots=True)
class AlignedPairs:
    """align_pairs' result: which pair each slot of a block holds, and each block's expert."""

    sorted_pairs: torch.Tensor  # [num_blocks * block_m] int32: a pair id (t * K + k), or num_pairs for padding
    block_experts: torch.Tensor  # [num_blocks] int32: the expert of every slot of the block; -1: an empty block
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_experts.shape[0]


def align_pairs(top_experts: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """top_experts: [T, K] integer expert ids -> the pairs sorted by expert, each expert's run padded to block_m.

    Torch ops only, none that reads a value back to the host (no bincount, nonzero or .item()): the shapes depend
    on T, K, num_experts and block_m alone, as a CUDA graph's replay needs."""
    flat = top_experts.reshape(-1).long()  # [P]
    num_pairs, device = flat.shape[0], flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m  # [E]: 0 for an expert without pairs
    padded_ends = padded_counts.cumsum(0)  # [E]: expert e's run ends here
    padded_starts = padded_ends - padded_counts
    starts = counts.cumsum(0) - counts  # [E]: where expert e's pairs start in the unpadded sorted order
    order = torch.argsort(flat, stable=True)  # [P]: pair ids grouped by expert, token order within one
    sorted_experts = flat.index_select(0, order)
    rank_in_expert = torch.arange(num_pairs, device=device) - starts.index_select(0, sorted_experts)
    slots = padded_starts.index_select(0, sorted_experts) + rank_in_expert  # [P]: each sorted pair's slot
    # every expert with pairs pads its run by at most block_m - 1 slots, and at most min(E, P) experts have pairs
    num_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, slots, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m
    # the expert whose padded run holds the block's first slot; right=True steps over experts with empty runs
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_starts < padded_ends[-1], block_experts, -1).to(torch.int32)
    return AlignedPairs(sorted_pairs, block_experts, block_m)


@triton.jit
def _expert_matmul_kernel(
    # pointers
    x_ptr,  # [rows, K] float: one row per token (ROWS_PER_TOKEN = top_k) or per pair (ROWS_PER_TOKEN = 1)
    weight_ptr,  # [E, N, K] in x's dtype (BITS 0), or uint8 codes [E, N, K * BITS / 8]
    scales_ptr,  # [E, N, K / GROUP_SIZE] float32; read only when BITS > 0
    mins_ptr,  # [E, N, K / GROUP_SIZE] float32; read only when BITS > 0
    out_ptr,  # [P, N] x's dtype: row p is pair p's output
    pair_weights_ptr,  # [P] float: each pair's routing weight; read only when HAS_PAIR_WEIGHTS
    bias_ptr,  # [E, N] x's dtype: each expert's output bias (gpt-oss); read only when HAS_BIAS
    sorted_pairs_ptr,  # [num_blocks * BLOCK_M] int32: align_pairs' slots (num_pairs for padding)
    block_experts_ptr,  # [num_blocks] int32: each block's expert, -1 for none
    # sizes
    N, K, num_pairs,
    # strides (the last dimension of every tensor is contiguous; scales and mins share theirs)
    stride_x_row, stride_weight_expert, stride_weight_row, stride_scales_expert, stride_scales_row, stride_out_row,
    stride_bias_expert,
    # meta-parameters
    ROWS_PER_TOKEN: tl.constexpr,  # x's row of pair p is p // ROWS_PER_TOKEN
    BITS: tl.constexpr,  # 0: float weights; 4 or 8: group-quantized codes
    GROUP_SIZE: tl.constexpr,  # the quantization group (BITS > 0)
    HAS_PAIR_WEIGHTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in float32: the interpreter's bfloat16 tl.dot is wrong (see _upcast)
    INPUT_PRECISION: tl.constexpr,  # "ieee" for float32 operands: tf32 would round them
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert < 0:  # past the last expert's run: padding blocks of the bound
        return
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    pair_mask = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_mask = cols < N
    depth = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pairs // ROWS_PER_TOKEN).to(tl.int64)[:, None] * stride_x_row + depth[None, :]
    # the weight tile is read transposed, [BLOCK_K, BLOCK_N], so that tl.dot(x, w) is x @ w.T
    w_rows = weight_ptr + expert.to(tl.int64) * stride_weight_expert + cols.to(tl.int64)[None, :] * stride_weight_row
    scale_rows = expert.to(tl.int64) * stride_scales_expert + cols.to(tl.int64)[None, :] * stride_scales_row
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + depth  # [BLOCK_K]
        depth_mask = k < K
        tile_mask = depth_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptrs + start, mask=pair_mask[:, None] & depth_mask[None, :], other=0.0)
        if BITS == 0:
            w = tl.load(w_rows + k[:, None], mask=tile_mask, other=0.0)
        else:
            if BITS == 4:  # byte j of a group of 32 holds its columns j (low nibble) and j + 16 (high)
                byte = (k // GROUP_SIZE) * (GROUP_SIZE // 2) + k % (GROUP_SIZE // 2)
                shift = (k % GROUP_SIZE) // (GROUP_SIZE // 2) * 4
                codes = (tl.load(w_rows + byte[:, None], mask=tile_mask, other=0) >> shift[:, None]) & 0x0F
            else:
                codes = tl.load(w_rows + k[:, None], mask=tile_mask, other=0)
            group = (k // GROUP_SIZE)[:, None]
            scales = tl.load(scales_ptr + scale_rows + group, mask=tile_mask, other=0.0)
            mins = tl.load(mins_ptr + scale_rows + group, mask=tile_mask, other=0.0)
            w = (codes.to(tl.float32) * scales + mins).to(x_ptr.dtype.element_ty)  # rounded once to x's dtype
        if UPCAST:
            x, w = x.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
    if HAS_BIAS:  # before the routing weight, as GptOssExperts: (x @ W + b) * weight
        acc = acc + tl.load(bias_ptr + expert.to(tl.int64) * stride_bias_expert + cols, mask=col_mask,
                            other=0.0).to(tl.float32)[None, :]
    if HAS_PAIR_WEIGHTS:
        acc = acc * tl.load(pair_weights_ptr + pairs, mask=pair_mask, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=pair_mask[:, None] & col_mask[None, :])


def _upcast(x: torch.Tensor) -> bool:
    # The Triton interpreter multiplies bfloat16 tl.dot operands as the raw uint16 bit patterns it stores
    # them in, so off CUDA the kernel multiplies in float32 (bf16 x bf16 products are exact in float32)
    return x.dtype == torch.bfloat16 and x.device.type != "cuda"


def block_sizes(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) by the mean pairs per expert that has any: decode spreads a few pairs over
    many experts, so short blocks waste less padding; prefill fills tall ones. vLLM's defaults' shape, not tuned
    on a device yet."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if per_expert <= 16:
        return 16, 64, 64
    if per_expert <= 64:
        return 32, 64, 64
    return 64, 64, 32


def expert_matmul(x: torch.Tensor, weight: ExpertWeights, aligned: AlignedPairs, num_pairs: int,
                  rows_per_token: int, pair_weights: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [P / rows_per_token, K]; weight: [E, N, K] (or group-quantized); bias: [E, N] or None -> [P, N] in x's
    dtype: row p = (x[p // rows_per_token] @ weight[e].T + bias[e]) (times pair_weights[p] when given), e the expert
    of p. One launch over every expert's blocks."""
    num_experts, num_outputs, depth = weight.shape
    out = torch.empty((num_pairs, num_outputs), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = aligned.block_m, *block_sizes(num_pairs, num_experts)[1:]
    if isinstance(weight, GroupQuantExperts):
        codes, scales, mins, bits, group_size = (weight.codes, weight.scales, weight.mins, weight.bits,
                                                 weight.group_size)
    else:  # the scale pointers are never read
        codes, scales, mins, bits, group_size = weight, weight, weight, 0, 1
    upcast = _upcast(x)
    _expert_matmul_kernel[(aligned.num_blocks, triton.cdiv(num_outputs, block_n))](
        x, codes, scales, mins, out, pair_weights if pair_weights is not None else x,
        bias if bias is not None else x, aligned.sorted_pairs, aligned.block_experts,
        num_outputs, depth, num_pairs,
        x.stride(0), codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1), out.stride(0),
        bias.stride(0) if bias is not None else 0,
        ROWS_PER_TOKEN=rows_per_token, BITS=bits, GROUP_SIZE=group_size, HAS_PAIR_WEIGHTS=pair_weights is not None,
        HAS_BIAS=bias is not None,
        UPCAST=upcast,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def _check_experts(where: str, name: str, weight: ExpertWeights, shape: tuple[int | None, ...],
                   x: torch.Tensor) -> tuple[int, int, int]:
    """weight's (E, N, K) after checking it against shape ([E, N, K], None where any size goes)."""
    if isinstance(weight, GroupQuantExperts):
        if (weight.bits, weight.group_size) not in LAYOUTS:
            raise ValueError(f"{where}: {name} has bits={weight.bits}, group_size={weight.group_size}, expected one "
                             f"of " + ", ".join(f"bits={b}, group_size={g}" for b, g in LAYOUTS))
        depth = shape[2]
        if depth is not None and depth % weight.group_size:
            raise ValueError(f"{where}: {name} is quantized in groups of {weight.group_size}, which do not divide "
                             f"its rows of {depth}")
        groups = None if depth is None else depth // weight.group_size
        check_tensor(where, f"{name}.scales", weight.scales, (*shape[:2], groups), (torch.float32,), x.device)
        check_tensor(where, f"{name}.mins", weight.mins, tuple(weight.scales.shape), (torch.float32,), x.device)
        num_experts, num_outputs, depth = weight.shape
        codes_shape = (num_experts, num_outputs, depth * weight.bits // 8)
        check_tensor(where, f"{name}.codes", weight.codes, codes_shape, (torch.uint8,), x.device)
        tensors = {"codes": weight.codes, "scales": weight.scales, "mins": weight.mins}
    else:
        check_tensor(where, name, weight, shape, (x.dtype,), x.device, dtype_from="x")
        tensors = {"": weight}
    for part, tensor in tensors.items():
        if tensor.stride(1) != tensor.shape[2]:
            label = f"{name}.{part}" if part else name
            raise ValueError(f"{where}: {label} has strides {list(tensor.stride())}, expected each expert's rows "
                             f"dense ([*, {tensor.shape[2]}, 1])")
    return weight.shape


def _check_biases(where: str, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                  gate_up: ExpertWeights, down: ExpertWeights, x: torch.Tensor) -> None:
    for name, bias, weight in (("gate_up_bias", gate_up_bias, gate_up), ("down_bias", down_bias, down)):
        if bias is not None:
            check_tensor(where, name, bias, tuple(weight.shape[:2]), (x.dtype,), x.device, dtype_from="x")
            if bias.stride(1) != 1:
                raise ValueError(f"{where}: {name} has strides {list(bias.stride())}, expected dense rows")


def _gated(gate: torch.Tensor, up: torch.Tensor, hidden_act: str, swiglu: tuple[float, float] | None,
           dtype: torch.dtype) -> torch.Tensor:
    """[P, I] each -> the experts' activation [P, I] in dtype, off the SiLU·mul kernel (GeLU-tanh, gpt-oss's clamped
    SwiGLU), in float32 elementwise torch."""
    gate, up = gate.float(), up.float()
    if swiglu is None:
        return (F.gelu(gate, approximate="tanh") * up).to(dtype)
    limit, alpha = swiglu
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * alpha))).to(dtype)


def _check_inputs(where: str, x: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor,
                  gate_up: ExpertWeights, down: ExpertWeights, hidden_act: str) -> None:
    if hidden_act not in ACTIVATIONS:
        raise ValueError(f"{where}: hidden_act={hidden_act!r} is not one of {list(ACTIVATIONS)}")
    check_tensor(where, "x", x, (None, None), FLOAT_DTYPES)
    num_tokens, hidden = x.shape
    check_tensor(where, "top_experts", top_experts, (num_tokens, None), (torch.int64, torch.int32), x.device)
    check_tensor(where, "top_weights", top_weights, tuple(top_experts.shape),
                 tuple(dict.fromkeys((torch.float32, x.dtype))), x.device)
    num_experts, double_inter, _ = _check_experts(where, "gate_up", gate_up, (None, None, hidden), x)
    if double_inter % 2:
        raise ValueError(f"{where}: gate_up has {double_inter} rows per expert, expected an even number "
                         f"(gate rows, then as many up rows)")
    _check_experts(where, "down", down, (num_experts, hidden, double_inter // 2), x)
    if top_experts.shape[1] > num_experts:
        raise ValueError(f"{where}: top_experts chooses {top_experts.shape[1]} experts per token, more than the "
                         f"{num_experts} there are")


def fused_moe(x: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor, gate_up: ExpertWeights,
              down: ExpertWeights, hidden_act: str = "silu", out: torch.Tensor | None = None, *,
              gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """x: [T, H] float (rows may be strided); top_weights: [T, K] float32 or x's dtype; top_experts: [T, K] int64 /
    int32 in [0, E); gate_up: [E, 2I, H] (gate rows, then up) and down: [E, H, I], x's dtype or GroupQuantExperts
    -> out [T, H] in x's dtype (allocated when None, else written and returned):
    out[t] = sum_k top_weights[t, k] * down_e @ (act(gate_e @ x[t]) * (up_e @ x[t])), e = top_experts[t, k].
    gpt-oss: gate_up_bias [E, 2I] / down_bias [E, H] added to each matmul, swiglu (limit, alpha) its clamped
    SwiGLU in place of act(gate) * up."""
    _check_inputs("fused_moe", x, top_weights, top_experts, gate_up, down, hidden_act)
    _check_biases("fused_moe", gate_up_bias, down_bias, gate_up, down, x)
    num_tokens, top_k = top_experts.shape
    out = output_tensor("fused_moe", "out", out, tuple(x.shape), x, dtype_from="x")
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return out.zero_()
    num_experts, inter = gate_up.shape[0], down.shape[2]  # gate_up / down: a tensor's or GroupQuantExperts' shape
    aligned = align_pairs(top_experts, num_experts, block_sizes(num_pairs, num_experts)[0])
    gate_up_out = expert_matmul(x, gate_up, aligned, num_pairs, rows_per_token=top_k, bias=gate_up_bias)  # [P, 2I]
    gate, up = gate_up_out[:, :inter], gate_up_out[:, inter:]
    if hidden_act == "silu" and swiglu is None:
        act = silu_and_mul(gate, up)  # [P, I]
    else:
        act = _gated(gate, up, hidden_act, swiglu, x.dtype)
    pair_out = expert_matmul(act, down, aligned, num_pairs, rows_per_token=1,
                             pair_weights=top_weights.reshape(-1), bias=down_bias)  # [P, H], weighted
    per_token = pair_out.view(num_tokens, top_k, -1)
    if x.dtype == torch.float32:
        return torch.sum(per_token, dim=1, out=out)
    return out.copy_(per_token.sum(dim=1, dtype=torch.float32))


def fused_moe_torch(x: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor, gate_up: ExpertWeights,
                    down: ExpertWeights, hidden_act: str = "silu", *, gate_up_bias: torch.Tensor | None = None,
                    down_bias: torch.Tensor | None = None, swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """fused_moe in plain float32 torch, one token and one choice at a time -> [T, H] float32 (unrounded);
    group-quantized experts dequantized to float32 first."""
    _check_inputs("fused_moe_torch", x, top_weights, top_experts, gate_up, down, hidden_act)
    _check_biases("fused_moe_torch", gate_up_bias, down_bias, gate_up, down, x)
    gate_up, down = (w.dequantize() if isinstance(w, GroupQuantExperts) else w for w in (gate_up, down))
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for token in range(x.shape[0]):
        for weight, expert in zip(top_weights[token].tolist(), top_experts[token].tolist()):
            gate_up_row = gate_up[expert].float() @ x[token].float()  # [2I]
            if gate_up_bias is not None:
                gate_up_row = gate_up_row + gate_up_bias[expert].float()
            gate, up = gate_up_row[:inter], gate_up_row[inter:]
            if swiglu is not None:
                gated = _gated(gate, up, hidden_act, swiglu, torch.float32)
            else:
                gated = (F.gelu(gate, approximate="tanh") if hidden_act == "gelu_tanh" else F.silu(gate)) * up
            down_row = down[expert].float() @ gated
            if down_bias is not None:
                down_row = down_row + down_bias[expert].float()
            out[token] += weight * down_row
    return out
