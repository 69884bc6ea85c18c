"""Group-quantized weight-only matmul: y = x @ W.T + bias with W[n, k] = scales[n, g] * code[n, k] + mins[n, g],
g = k // group_size, the codes dequantized inside the K loop (worker/linears/group_quant.py's format, which every
GGUF weight format and --quantization int4|int8 load into).

Codes are unsigned bytes: 8-bit containers hold one code a byte ([N, K], groups of 32 or 16); 4-bit
containers pack a group of 32 in 16 bytes, element j in the low nibble of byte j and element j + 16 in the
high one ([N, K / 2], llama.cpp's Q4_0 / Q4_1 layout). So the low nibbles of a group's 16 bytes are its
first 16 columns and the high nibbles its last 16: the kernel multiplies each half by its own 16 columns
of x, and never interleaves nibbles.

Per group, the kernel multiplies x by the raw codes (integers below 256, exact in float16 / bfloat16) into
a float32 partial sum and applies the group's scale to it, and adds mins[n, g] * sum(x over the group):
    y[m, n] = sum_g scales[n, g] * (x_g[m] . code_g[n]) + mins[n, g] * sum(x_g[m])
so no dequantized weight is rounded to x's dtype; the result is rounded once, at the end.

Decode (at most GEMV_MAX_ROWS rows) takes a second kernel: there the K loop of the tiled kernel, one group
and two 16-deep dots a step, is latency-bound (an H200 read int4 codes at 7% of its copy bandwidth through it,
3.5x slower than bfloat16 weights). The GEMV kernel reads BLOCK_GROUPS groups of BLOCK_N rows a step as one
coalesced tile, multiplies in float32 on the CUDA cores (the same per-group sums, scale and min applied per
group, nothing rounded before the end) and reuses the tile for each of its rows.

A third kernel, kernel="dequant", dequantizes a tile of BLOCK_GROUPS groups into x's dtype (scale * code + min
in float32, rounded once) and multiplies it in one deep tensor-core dot per K step, as GPTQ/AWQ Triton
kernels do: the tiled kernel's one-group K steps are what keeps int4 behind bfloat16 weights from 8 to 64
rows on an H200. Not measured on a device yet, so "auto" does not pick it.

group_quant_matmul_torch is the same computation in plain torch (the weight dequantized to float32), the
reference in the tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from worker.kernels.checks import FLOAT_DTYPES, check_tensor, output_tensor

# (bits, group_size) the kernel runs: llama.cpp's 4-bit blocks hold 32 codes; Q6_K's 8-bit groups hold 16
LAYOUTS = ((4, 32), (8, 32), (8, 16))
# Up to this many rows the codes are read once for all rows, on the CUDA cores. On an H200 (Llama-3-8B
# shapes, 4-bit groups of 32) the GEMV kernel beat the tiled one 3.9-5.4x at 1 row, 1.5-2.5x at 4 and
# summed over a decoder layer's four linears still 7% at 8 (tests/gpu/bench_group_quant.py).
GEMV_MAX_ROWS = 8
# (BLOCK_N, BLOCK_GROUPS, num_warps): the fastest of 27 on that H200 at 1 row, summed over the five
# shapes (279 us; 32/8/4 took 332, 64/4/2 580): narrow column tiles give enough programs for 132 SMs
GEMV_CONFIG = (16, 16, 4)
# What "auto" runs above GEMV_MAX_ROWS: "tiled" until a device shows "dequant" faster (tests/gpu/run.sh
# measures both, kernel alone and in the 8B decode step; bench_decode --many-rows-kernel sets this)
MANY_ROWS_KERNEL = "tiled"


@triton.jit
def _group_quant_matmul_kernel(
    # pointers
    x_ptr,  # [M, K] float
    codes_ptr,  # [N, K] uint8 (BITS 8) or [N, K / 2] uint8 (BITS 4, two codes a byte)
    scales_ptr,  # [N, K / GROUP_SIZE] float32
    mins_ptr,  # [N, K / GROUP_SIZE] float32
    bias_ptr,  # [N], float32 or x's dtype; read only when HAS_BIAS
    out_ptr,  # [M, N], x's dtype
    # sizes
    M, N, num_groups,
    # strides (the last dimension of every tensor is contiguous)
    stride_x_row, stride_codes_row, stride_scales_row, stride_mins_row, stride_out_row,
    # meta-parameters
    BITS: tl.constexpr,  # 4 or 8: the codes' container
    GROUP_SIZE: tl.constexpr,  # 32 (4- or 8-bit) or 16 (8-bit)
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,  # multiply in float32 (bfloat16 under the interpreter, see _dot_upcast)
    INPUT_PRECISION: tl.constexpr,  # "ieee" for float32 operands: tf32 would miss the float32 tolerance
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # one K step is one group: its scale and min are constant over the step, so they apply to a partial sum
    HALF: tl.constexpr = GROUP_SIZE // 2
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_mask, col_mask = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_row  # [BLOCK_M, 1]
    code_cols = codes_ptr + cols.to(tl.int64)[None, :] * stride_codes_row  # [1, BLOCK_N]
    scale_ptrs = scales_ptr + cols.to(tl.int64) * stride_scales_row  # [BLOCK_N]
    min_ptrs = mins_ptr + cols.to(tl.int64) * stride_mins_row  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BITS == 4:
        depth = tl.arange(0, HALF)  # [16]: byte j of a group holds columns j and j + 16
        for group in range(num_groups):
            x_lo = tl.load(x_rows + group * GROUP_SIZE + depth[None, :], mask=row_mask[:, None], other=0.0)
            x_hi = tl.load(x_rows + group * GROUP_SIZE + HALF + depth[None, :], mask=row_mask[:, None], other=0.0)
            # the code tile is read transposed, [16, BLOCK_N], so that tl.dot(x, codes) is x @ codes.T
            packed = tl.load(code_cols + group * HALF + depth[:, None], mask=col_mask[None, :], other=0)
            if UPCAST:
                x_lo, x_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
            partial = tl.dot(x_lo, (packed & 0x0F).to(x_lo.dtype), input_precision=INPUT_PRECISION)
            partial = tl.dot(x_hi, (packed >> 4).to(x_hi.dtype), partial, input_precision=INPUT_PRECISION)
            x_sum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)  # [BLOCK_M]
            scales = tl.load(scale_ptrs + group, mask=col_mask, other=0.0)
            mins = tl.load(min_ptrs + group, mask=col_mask, other=0.0)
            acc += partial * scales[None, :] + x_sum[:, None] * mins[None, :]
    else:
        depth = tl.arange(0, GROUP_SIZE)
        for group in range(num_groups):
            x = tl.load(x_rows + group * GROUP_SIZE + depth[None, :], mask=row_mask[:, None], other=0.0)
            codes = tl.load(code_cols + group * GROUP_SIZE + depth[:, None], mask=col_mask[None, :], other=0)
            if UPCAST:
                x = x.to(tl.float32)
            partial = tl.dot(x, codes.to(x.dtype), input_precision=INPUT_PRECISION)
            x_sum = tl.sum(x.to(tl.float32), axis=1)
            scales = tl.load(scale_ptrs + group, mask=col_mask, other=0.0)
            mins = tl.load(min_ptrs + group, mask=col_mask, other=0.0)
            acc += partial * scales[None, :] + x_sum[:, None] * mins[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _group_quant_gemv_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr, M, N, num_groups,  # as _group_quant_matmul_kernel
    stride_x_row, stride_codes_row, stride_scales_row, stride_mins_row, stride_out_row,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,  # the weights' format
    GROUP_BYTES: tl.constexpr,  # a group's bytes in its container: GROUP_SIZE * BITS / 8
    HAS_BIAS: tl.constexpr,
    ROWS: tl.constexpr,  # M padded to a power of two, at most GEMV_MAX_ROWS
    BLOCK_N: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,  # groups per K step
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_mask = cols < N
    rows = tl.arange(0, ROWS)
    depth = tl.arange(0, GROUP_BYTES)  # byte j of a 4-bit group holds columns j and j + 16
    code_rows = codes_ptr + cols.to(tl.int64)[:, None, None] * stride_codes_row  # [BLOCK_N, 1, 1]
    scale_rows = scales_ptr + cols.to(tl.int64)[:, None] * stride_scales_row  # [BLOCK_N, 1]
    min_rows = mins_ptr + cols.to(tl.int64)[:, None] * stride_mins_row
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for first in range(0, num_groups, BLOCK_GROUPS):
        groups = first + tl.arange(0, BLOCK_GROUPS)  # [BLOCK_GROUPS]
        group_mask = groups < num_groups
        tile_mask = col_mask[:, None] & group_mask[None, :]  # [BLOCK_N, BLOCK_GROUPS]
        packed = tl.load(code_rows + groups[None, :, None] * GROUP_BYTES + depth[None, None, :],
                         mask=tile_mask[:, :, None], other=0)  # [BLOCK_N, BLOCK_GROUPS, GROUP_BYTES]
        scales = tl.load(scale_rows + groups[None, :], mask=tile_mask, other=0.0)
        mins = tl.load(min_rows + groups[None, :], mask=tile_mask, other=0.0)
        if BITS == 4:
            low, high = (packed & 0x0F).to(tl.float32), (packed >> 4).to(tl.float32)
        else:
            low = packed.to(tl.float32)
        x_offsets = groups[:, None] * GROUP_SIZE + depth[None, :]  # [BLOCK_GROUPS, GROUP_BYTES]
        for row in tl.static_range(ROWS):
            # a [BLOCK_GROUPS] tensor, not the scalar row < M: the interpreter's masked load takes no scalar bool
            x_mask = (group_mask & (tl.full([BLOCK_GROUPS], row, tl.int32) < M))[:, None]
            x_row = x_ptr + row * stride_x_row
            x_low = tl.load(x_row + x_offsets, mask=x_mask, other=0.0).to(tl.float32)
            dots = tl.sum(low * x_low[None, :, :], axis=2)  # [BLOCK_N, BLOCK_GROUPS]: code . x per group
            x_sum = tl.sum(x_low, axis=1)  # [BLOCK_GROUPS]
            if BITS == 4:
                x_high = tl.load(x_row + x_offsets + GROUP_BYTES, mask=x_mask, other=0.0).to(tl.float32)
                dots += tl.sum(high * x_high[None, :, :], axis=2)
                x_sum += tl.sum(x_high, axis=1)
            part = tl.sum(dots * scales + mins * x_sum[None, :], axis=1)  # [BLOCK_N]
            acc = tl.where(rows[:, None] == row, acc + part[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & col_mask[None, :])


@triton.jit
def _group_quant_dequant_kernel(
    x_ptr, codes_ptr, scales_ptr, mins_ptr, bias_ptr, out_ptr, M, N, num_groups,  # as _group_quant_matmul_kernel
    stride_x_row, stride_codes_row, stride_scales_row, stride_mins_row, stride_out_row,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr,  # the weights' format
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,  # groups per K step: one dot BLOCK_GROUPS * GROUP_SIZE deep (two for 4-bit)
):  # fmt: skip
    # The weight tile is dequantized into x's dtype (scale * code + min in float32, then rounded once) so
    # that a K step is one deep tensor-core dot instead of one 16-deep dot per group: the tiled kernel's
    # per-group dots left an H200 latency-bound from 8 to 64 rows (int4 2-3x slower than bfloat16 weights).
    # The price is one rounding of each dequantized weight to x's dtype (exact for float32 x).
    HALF: tl.constexpr = GROUP_SIZE // 2
    BYTES: tl.constexpr = BLOCK_GROUPS * GROUP_SIZE * BITS // 8  # the K step's bytes of one column
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x_row  # [BLOCK_M, 1]
    code_cols = codes_ptr + cols.to(tl.int64)[None, :] * stride_codes_row  # [1, BLOCK_N]
    byte = tl.arange(0, BYTES)  # [BYTES]: byte b of the step
    if BITS == 4:
        group_of_byte = byte // HALF
        k_low = group_of_byte * GROUP_SIZE + byte % HALF  # byte j of a group: columns j and j + 16
    else:
        group_of_byte = byte // GROUP_SIZE
        k_low = byte
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first in range(0, num_groups, BLOCK_GROUPS):
        groups = first + group_of_byte  # [BYTES]
        k_mask = groups < num_groups
        tile_mask = k_mask[:, None] & col_mask[None, :]  # [BYTES, BLOCK_N]
        packed = tl.load(code_cols + first * (GROUP_SIZE * BITS // 8) + byte[:, None], mask=tile_mask, other=0)
        scales = tl.load(scales_ptr + cols.to(tl.int64)[None, :] * stride_scales_row + groups[:, None],
                         mask=tile_mask, other=0.0)  # [BYTES, BLOCK_N], each group's repeated over its bytes
        mins = tl.load(mins_ptr + cols.to(tl.int64)[None, :] * stride_mins_row + groups[:, None],
                       mask=tile_mask, other=0.0)
        x_mask = row_mask[:, None] & k_mask[None, :]
        x_low = tl.load(x_rows + first * GROUP_SIZE + k_low[None, :], mask=x_mask, other=0.0)  # [BLOCK_M, BYTES]
        # each weight rounded once to x's dtype, under the interpreter too (then widened back: UPCAST)
        if BITS == 4:
            w_low = ((packed & 0x0F).to(tl.float32) * scales + mins).to(x_ptr.dtype.element_ty)
            w_high = ((packed >> 4).to(tl.float32) * scales + mins).to(x_ptr.dtype.element_ty)
            x_high = tl.load(x_rows + first * GROUP_SIZE + HALF + k_low[None, :], mask=x_mask, other=0.0)
            if UPCAST:
                x_low, x_high = x_low.to(tl.float32), x_high.to(tl.float32)
                w_low, w_high = w_low.to(tl.float32), w_high.to(tl.float32)
            acc = tl.dot(x_low, w_low, acc, input_precision=INPUT_PRECISION)
            acc = tl.dot(x_high, w_high, acc, input_precision=INPUT_PRECISION)
        else:
            w_low = (packed.to(tl.float32) * scales + mins).to(x_ptr.dtype.element_ty)
            if UPCAST:
                x_low, w_low = x_low.to(tl.float32), w_low.to(tl.float32)
            acc = tl.dot(x_low, w_low, acc, input_precision=INPUT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_out_row + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _check_inputs(
    where: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
    bits: int, group_size: int, bias: torch.Tensor | None,
) -> None:  # fmt: skip
    if (bits, group_size) not in LAYOUTS:
        raise ValueError(f"{where}: bits={bits}, group_size={group_size} is not a supported layout, expected one of "
                         + ", ".join(f"bits={b}, group_size={g}" for b, g in LAYOUTS))
    check_tensor(where, "x", x, (None, None), FLOAT_DTYPES)
    in_features = x.shape[1]
    if in_features % group_size:
        raise ValueError(f"{where}: x has {in_features} columns, expected a multiple of group_size {group_size}")
    check_tensor(where, "codes", codes, (None, in_features * bits // 8), (torch.uint8,), x.device)
    num_outputs = codes.shape[0]
    num_groups = in_features // group_size
    check_tensor(where, "scales", scales, (num_outputs, num_groups), (torch.float32,), x.device)
    check_tensor(where, "mins", mins, (num_outputs, num_groups), (torch.float32,), x.device)
    if bias is not None:
        check_tensor(where, "bias", bias, (num_outputs,), tuple(dict.fromkeys((torch.float32, x.dtype))), x.device)


def dequantize_group_quant(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int,
                           group_size: int) -> torch.Tensor:
    """The float32 weight [N, K] the codes stand for."""
    num_outputs, num_groups = scales.shape
    if bits == 4:  # [N, groups, 16] bytes -> [N, groups, 32] codes: low nibbles first, then high ones
        packed = codes.view(num_outputs, num_groups, group_size // 2)
        codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1)
    codes = codes.reshape(num_outputs, num_groups, group_size).float()
    return (codes * scales[..., None] + mins[..., None]).view(num_outputs, -1)


def group_quant_matmul_torch(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int, group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x: [M, K] float; codes / scales / mins as group_quant_matmul -> [M, N] in x's dtype.

    Plain torch in float32 on the dequantized weight, rounded once at the end."""
    _check_inputs("group_quant_matmul_torch", x, codes, scales, mins, bits, group_size, bias)
    weight = dequantize_group_quant(codes, scales, mins, bits, group_size)
    out = F.linear(x.float(), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


def _dot_upcast(x: torch.Tensor) -> bool:
    # The Triton interpreter multiplies bfloat16 tl.dot operands as the raw uint16 bit patterns it stores
    # them in, so off CUDA the kernel multiplies in float32; on CUDA bf16 x code -> float32 is exact and fast.
    return x.dtype == torch.bfloat16 and x.device.type != "cuda"


def _block_sizes(num_rows: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N). Small M is decode, bound by reading the codes: narrow N tiles give enough
    programs to keep every SM streaming. Not tuned on a device yet."""
    if num_rows <= 16:
        return 16, 32
    if num_rows <= 64:
        return 64, 64
    return 128, 64


def _dequant_config(num_rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_GROUPS, num_warps) of the dequantizing kernel: a first guess (4 groups a K
    step), to be swept on a device with tests/gpu/bench_group_quant.py."""
    block_m = 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64
    return block_m, 64, 4, 4


def group_quant_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    gemv_config: tuple[int, int, int] | None = None,
    kernel: str = "auto",
    dequant_config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x: [M, K] float (rows may be strided); codes: uint8 [N, K] (bits 8) or [N, K / 2] (bits 4, packed);
    scales, mins: float32 [N, K / group_size]; bias: [N] float32 or x's dtype, or None
    -> out [M, N] in x's dtype (allocated when None, else written and returned).
    gemv_config: (BLOCK_N, BLOCK_GROUPS, num_warps) for M <= GEMV_MAX_ROWS instead of GEMV_CONFIG; kernel:
    "auto" (the GEMV kernel up to GEMV_MAX_ROWS rows, then MANY_ROWS_KERNEL), "tiled" at any row count, or
    "dequant" (the weight tile dequantized into x's dtype for one deep dot a K step; not yet measured on a
    device, so not auto's choice); dequant_config: its (BLOCK_M, BLOCK_N, BLOCK_GROUPS, num_warps)
    instead of _dequant_config's (the last three for benchmarks)."""
    _check_inputs("group_quant_matmul", x, codes, scales, mins, bits, group_size, bias)
    num_rows, in_features = x.shape
    num_outputs = codes.shape[0]
    out = output_tensor("group_quant_matmul", "out", out, (num_rows, num_outputs), x)
    if num_rows == 0 or num_outputs == 0:
        return out
    bias_or_any = bias if bias is not None else scales  # a pointer the kernel never reads without HAS_BIAS
    if kernel not in ("auto", "tiled", "dequant"):
        raise ValueError(f"group_quant_matmul: kernel={kernel!r}, expected 'auto', 'tiled' or 'dequant'")
    if kernel == "auto" and num_rows > GEMV_MAX_ROWS:
        kernel = MANY_ROWS_KERNEL
    # every kernel's pointers, sizes and strides, in its signature's order
    shared = (x, codes, scales, mins, bias_or_any, out, num_rows, num_outputs, in_features // group_size,
              x.stride(0), codes.stride(0), scales.stride(0), mins.stride(0), out.stride(0))
    if kernel == "auto":
        block_n, block_groups, num_warps = gemv_config or GEMV_CONFIG
        _group_quant_gemv_kernel[(triton.cdiv(num_outputs, block_n),)](
            *shared, BITS=bits, GROUP_SIZE=group_size, GROUP_BYTES=group_size * bits // 8,
            HAS_BIAS=bias is not None, ROWS=triton.next_power_of_2(num_rows),
            BLOCK_N=block_n, BLOCK_GROUPS=block_groups, num_warps=num_warps,
        )  # fmt: skip
        return out
    upcast = _dot_upcast(x)
    dot_options = dict(BITS=bits, GROUP_SIZE=group_size, HAS_BIAS=bias is not None, UPCAST=upcast,
                       INPUT_PRECISION="ieee" if x.dtype == torch.float32 or upcast else "tf32")
    if kernel == "dequant":
        block_m, block_n, block_groups, num_warps = dequant_config or _dequant_config(num_rows)
        grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_outputs, block_n))
        _group_quant_dequant_kernel[grid](*shared, **dot_options, BLOCK_M=block_m, BLOCK_N=block_n,
                                          BLOCK_GROUPS=block_groups, num_warps=num_warps)
        return out
    block_m, block_n = _block_sizes(num_rows)
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_outputs, block_n))
    _group_quant_matmul_kernel[grid](*shared, **dot_options, BLOCK_M=block_m, BLOCK_N=block_n)
    return out
