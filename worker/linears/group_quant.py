"""Group-quantized weights (W[n, k] = scale[n, g] * code[n, k] + min[n, g], g = k // group_size) and the
linear that runs on them without expanding them to float32.

One format holds every weight-only format we load: llama.cpp's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (group
32) and its K-quants Q4_K / Q5_K (group 32, 4- and 5-bit codes) and Q6_K (group 16, 6-bit codes) map onto it exactly,
each GGUF block's scale and minimum becoming the group's (worker/loader/gguf_quants.py); a Hugging Face
folder's float weights are quantized into it at load by --quantization int4|int8 (quantize_weight, with
the rounding error that brings). Codes are unsigned: 8-bit codes one byte each, 4-bit codes packed as
llama.cpp packs Q4_0/Q4_1 (a group of 32 in 16 bytes, element j low nibble and j + 16 high nibble of byte j).

On CPU the matmul is the compiled op (worker/csrc/group_quant_linear.cpp) for few rows, where decoding
is bound by reading the weights, and for many rows (prefill, batched decode), where it is bound by
arithmetic, a GEMM on strips of the weight it dequantizes, or one GEMM on a dense copy of the weight kept
for that (worker.linears.dense_weights, --cpu-dense-weights). Without the compiled op, torch ops compute the same thing. On CUDA the
Triton kernel worker/kernels/group_quant_matmul.py dequantizes the codes inside its K loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from worker.linears.dense_linear import dense_linear
from worker.linears.int8 import Int8Linear
from worker.linears.swap import replace_linears
from worker.native_ops import cpu_has_native_bf16, cpu_ops_available

# Above this many rows a float32 GEMM on strips of the dequantized weight beats the row-streaming
# kernel; at most STRIP_ROWS rows of W are dequantized at a time (in cache), fewer where that would
# leave a thread idle. Measured on the default model's linears, two threads, min of 3
# (scripts/bench_group_quant.py), microseconds:
#   gate_up 8 rows: f32 364, q4 rows 505, q4 strips 620; 32 rows: 961 / 1956 / 1245
#   lm_head 1 row: f32 5651, q4 rows 2217; 8 rows: 8386 / 7630 / 9010; 32 rows: 16827 / 26426 / 18919
# (f32 there is oneDNN on a packed weight the benchmark keeps in cache, which a served model's 540 MB do not)
GEMM_ROWS = 8
# From this many rows a dense copy of the weight, where one is kept (worker.linears.dense_weights), beats the codes.
# The row kernels read the codes once per 4 rows, so 5 rows pay a second pass. The default model's decode
# step, bfloat16, two threads, codes -> dense, ms: Sapphire Rapids (AMX), float32 row kernel: 2 rows
# 22.5 -> 24.8, 4 rows 26.6 -> 26.3, 8 rows 44.4 -> 25.9; AMD EPYC (avx512_bf16, no AMX), the bfloat16 row
# kernel, one process alternating: 2 rows 10.4 -> 19.3, 4 rows 14.1 -> 18.1, 6 rows 20.5 -> 20.0, 8 rows
# 24.8 -> 23.8
DENSE_ROWS = 5
STRIP_ROWS = 256
STRIP_BYTES = 2**20  # a bfloat16 strip's most: one core's L2 here
# --cpu-int8-activations: up to this many rows the integer-dot kernel runs; above, the strips (the
# activations stay float32 there). Two threads, min of 3, microseconds (scripts/bench_group_quant.py):
#   gate_up 1 row: q4 float kernel 161, int8 87; 16 rows: strips 788, int8 719; 32 rows: 1347 / 1500
#   lm_head (q4) 1 row: 2184 / 1198; 16 rows: strips 12985, int8 11423; 32 rows: 20647 / 23055
INT8_ROWS = 16


def strip_rows(out_features: int, threads: int, in_features: int, element_size: int = 4) -> int:
    """Rows of W per dequantized strip (group_quant_linear_strips).

    float32: at most STRIP_ROWS rows, at least two strips per thread where the weight allows (a 576-row
    weight in 256-row strips kept one of two threads idle a third of the time: 3065 vs 2254 us).
    bfloat16: each GEMM call costs oneDNN tens of microseconds whatever its size, as much as a 240-row
    strip's arithmetic at 32 rows, so as few strips as keep each in L2 (1 MiB) and every thread busy:
    a multiple of the thread count. Two threads, AVX-512 bf16, 32 rows, microseconds: qkv (960 rows)
    294 in 144-row strips, 200 in 240, 164 in 480 (one GEMM on a bfloat16 weight: 139-168); down (K 1536)
    308 in 144, 253 in 288 (194-225); lm_head 12.1 ms in 128, 9.0 in 512, 8.1 in 1024 (7.9)."""
    threads = max(threads, 1)
    if element_size == 4:
        per_strip = -(-out_features // (2 * threads))
        return min(STRIP_ROWS, max(64, -(-per_strip // 16) * 16))
    most = max(64, STRIP_BYTES // (in_features * element_size))
    strips = threads * -(-out_features // (threads * most))
    return -(-out_features // strips // 16) * 16 if out_features >= 16 * strips else out_features


@dataclass(slots=True)
class GroupQuantWeight:
    codes: torch.Tensor  # uint8 [N, K] (8-bit) or [N, K // 2] (4-bit, packed)
    scales: torch.Tensor  # float32 [N, K // group_size]
    mins: torch.Tensor  # float32 [N, K // group_size]
    bits: int  # 4 or 8: the container; the codes may use fewer bits (5-bit Q5_K, 6-bit Q6_K in 8)
    group_size: int
    source: str  # what the file held, e.g. "Q4_1" or "int4 (quantized at load)"

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits={self.bits}: group-quantized codes are 4 or 8 bits")
        if self.bits == 4 and self.group_size != 32:
            raise ValueError(f"4-bit codes are packed in groups of 32, not {self.group_size}")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.scales.shape[1] * self.group_size

    def unpacked_codes(self) -> torch.Tensor:  # uint8 [N, K]
        if self.bits == 8:
            return self.codes
        n = self.codes.shape[0]
        packed = self.codes.view(n, -1, 16)
        return torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(n, -1)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K]: the reference the compiled op is tested against."""
        n, groups = self.scales.shape
        codes = self.unpacked_codes().view(n, groups, self.group_size).float()
        return (codes * self.scales[..., None] + self.mins[..., None]).view(n, -1)

    def with_layout(self, bits: int, group_size: int) -> GroupQuantWeight:
        """The same weight (exactly) in a wider container / smaller groups: a fused projection needs one."""
        if (bits, group_size) == (self.bits, self.group_size):
            return self
        if bits < self.bits or self.group_size % group_size:
            raise ValueError(f"cannot hold a {self.bits}-bit group-{self.group_size} weight as {bits}-bit group-{group_size}")
        repeat = self.group_size // group_size
        codes = self.unpacked_codes() if bits == 8 else self.codes
        return GroupQuantWeight(codes.contiguous(), self.scales.repeat_interleave(repeat, dim=1).contiguous(),
                                self.mins.repeat_interleave(repeat, dim=1).contiguous(), bits, group_size, self.source)

    def rows(self, index: torch.Tensor) -> GroupQuantWeight:
        """A row permutation / selection (llama.cpp's q/k row order undone on the codes themselves)."""
        return GroupQuantWeight(self.codes[index].contiguous(), self.scales[index].contiguous(),
                                self.mins[index].contiguous(), self.bits, self.group_size, self.source)

    @staticmethod
    def concat_rows(parts: list[GroupQuantWeight]) -> GroupQuantWeight:
        """Fused q/k/v or gate/up: parts stacked along the output rows, in the widest layout any part needs."""
        bits = max(p.bits for p in parts)
        group_size = min(p.group_size for p in parts)
        parts = [p.with_layout(bits, group_size) for p in parts]
        sources = sorted({p.source for p in parts})
        return GroupQuantWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                                torch.cat([p.mins for p in parts]), bits, group_size, "+".join(sources))


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes < 16, [N, K] -> [N, K // 2] in llama.cpp's Q4 layout (see the module docstring)."""
    n = codes.shape[0]
    groups = codes.view(n, -1, 32)
    return (groups[..., :16] | (groups[..., 16:] << 4)).reshape(n, -1).contiguous()


def quantize_weight(weight: torch.Tensor, bits: int, group_size: int = 32) -> GroupQuantWeight:
    """Asymmetric round-to-nearest per group (scale = (max - min) / (2**bits - 1)), as llama.cpp's Q4_1 does."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"in_features {k} is not a multiple of the quantization group size {group_size}")
    groups = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    scales = (high - low) / (2**bits - 1)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round((groups - low[..., None]) / safe[..., None]).clamp_(0, 2**bits - 1).to(torch.uint8).view(n, k)
    packed = pack_nibbles(codes) if bits == 4 else codes.contiguous()
    return GroupQuantWeight(packed, scales.contiguous(), low.contiguous(), bits, group_size, f"int{bits} (quantized at load)")


@cache
def _cpu_ops():
    """The compiled ops' overloads (resolved once, after cpu_ops_available() loaded them)."""
    ops = torch.ops.tokenmill
    return ops.group_quant_linear.default, ops.group_quant_linear_int8_dot.default, ops.group_quant_linear_strips.default


def _float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype is torch.float32 else x.float()


class GroupQuantLinear(nn.Module):
    def __init__(self, weight: GroupQuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bits, self.group_size, self.source = weight.bits, weight.group_size, weight.source
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)
        self.register_buffer("bias", bias)
        # worker.linears.dense_weights: the weight dequantized and reordered for oneDNN, for steps of many rows
        self.register_buffer("dense_weight", None, persistent=False)
        self.int8_activations = False  # use_int8_activations()
        self.kernel = kernel_for(weight.codes.device)  # chosen where the buffers live; .to() chooses again

    def weight_view(self) -> GroupQuantWeight:
        return GroupQuantWeight(self.codes, self.scales, self.mins, self.bits, self.group_size, self.source)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        return self.kernel(self, x)

    def _apply(self, fn, recurse: bool = True):
        """Moving the buffers (.to(device)) chooses the kernel for their device, once, not each forward."""
        super()._apply(fn, recurse)
        self.kernel = kernel_for(self.codes.device)
        return self

    def forward_cpu_ops(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N], CPU, compiled ops loaded
        """The compiled ops, by row count: the dense copy for many rows (where one is kept), the int8-dot
        kernel for few rows under int8 activations, dequantized strips past GEMM_ROWS, else the row kernel."""
        # ~120 calls a decode step: the buffers dict and the op overloads are read directly, since at one
        # row every microsecond of Python here is a few percent of the step
        buffers = self._buffers
        codes, scales, mins, bias = buffers["codes"], buffers["scales"], buffers["mins"], buffers["bias"]
        dense, rows = buffers["dense_weight"], x.shape[0]
        linear, int8_dot, strips = _cpu_ops()
        if dense is not None and rows >= DENSE_ROWS and x.dtype is dense.dtype and not (
                self.int8_activations and rows <= INT8_ROWS):
            out = dense_linear(x, dense)
        elif self.int8_activations and rows <= INT8_ROWS:
            out = int8_dot(_float32(x), codes, scales, mins, self.bits, self.group_size)
        elif rows > GEMM_ROWS:
            # bfloat16 activations keep bfloat16 strips where the CPU multiplies them natively
            gemm_x = x if x.dtype is torch.bfloat16 and cpu_has_native_bf16() else _float32(x)
            out = strips(gemm_x, codes, scales, mins, self.bits, self.group_size,
                         strip_rows(self.out_features, torch.get_num_threads(), self.in_features,
                                    gemm_x.element_size()))
        else:
            # bfloat16 x goes in as it is: the op's bfloat16 kernel (avx512_bf16) reads it directly and
            # returns bfloat16, which saves the two copies a call that were ~4% of a one-row decode step
            out = linear(x if x.dtype is torch.bfloat16 else _float32(x), codes, scales, mins, self.bits,
                         self.group_size)
        if bias is not None:
            out.add_(bias)
        return out if out.dtype is x.dtype else out.to(x.dtype)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        """Without the compiled ops: the same numbers from torch ops, slower (a dense copy still serves many rows)."""
        dense, rows = self._buffers["dense_weight"], x.shape[0]
        if dense is not None and rows >= DENSE_ROWS and x.dtype is dense.dtype:
            out = dense_linear(x, dense)
        else:
            out = F.linear(_float32(x), self.weight_view().dequantize())
        if self.bias is not None:
            out.add_(self.bias)
        return out if out.dtype is x.dtype else out.to(x.dtype)

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N], CPU, compiled ops loaded
        """The row kernel (the int8-dot one under int8 activations) whatever the row count: each output is one
        dot per activation row in K order, so a row's result does not depend on the others (worker.paths.batch_invariant)."""
        linear, int8_dot, _ = _cpu_ops()
        if self.int8_activations:
            out = int8_dot(_float32(x), self.codes, self.scales, self.mins, self.bits, self.group_size)
        else:
            out = linear(x if x.dtype is torch.bfloat16 else _float32(x), self.codes, self.scales, self.mins, self.bits,
                         self.group_size)
        if self.bias is not None:
            out.add_(self.bias)
        return out if out.dtype is x.dtype else out.to(x.dtype)

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., K] -> [..., N], in x's dtype
        """The Triton kernel, which dequantizes the codes inside its K loop: forward's path for CUDA tensors
        (the tests run it on CPU tensors under the Triton interpreter)."""
        from worker.kernels.group_quant_matmul import group_quant_matmul

        rows = x.reshape(-1, self.in_features)  # a view for [T, K] rows, strided or not
        out = group_quant_matmul(rows, self.codes, self.scales, self.mins, self.bits, self.group_size, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, source={self.source!r}")


def kernel_for(device: torch.device) -> Callable[[GroupQuantLinear, torch.Tensor], torch.Tensor]:
    """The variant a GroupQuantLinear runs on device: the Triton kernel on CUDA, the compiled ops on a CPU
    that has them built, torch ops otherwise."""
    if device.type == "cuda":
        return GroupQuantLinear.forward_triton
    return GroupQuantLinear.forward_cpu_ops if cpu_ops_available() else GroupQuantLinear.forward_torch


class GroupQuantEmbedding(nn.Module):
    """A token embedding kept in its file's format: the looked-up rows are dequantized, nothing else
    (a 128k-token vocabulary is 2 GiB as float32 at hidden 4096). Tied to lm_head, both share the codes."""

    def __init__(self, weight: GroupQuantWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.bits, self.group_size, self.source, self.dtype = weight.bits, weight.group_size, weight.source, dtype
        self.register_buffer("codes", weight.codes)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        rows = GroupQuantWeight(self.codes.index_select(0, input_ids), self.scales.index_select(0, input_ids),
                                self.mins.index_select(0, input_ids), self.bits, self.group_size, self.source)
        return rows.dequantize().to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, source={self.source!r}"


def int8_dot_supports(bits: int, group_size: int) -> bool:
    """The layouts worker/csrc/group_quant_int8_dot.cpp reads: 4-bit group 32, 8-bit group 32 or 16 (Q6_K)."""
    return (bits, group_size) in ((4, 32), (8, 32), (8, 16))


def use_int8_activations(model: nn.Module) -> int:
    """--cpu-int8-activations: the group-quantized linears under model whose layout the integer-dot kernel
    reads (worker/csrc/group_quant_int8_dot.cpp) round their activations to int8, as llama.cpp does.
    Returns how many."""
    linears = [m for m in model.modules()
               if isinstance(m, GroupQuantLinear) and int8_dot_supports(m.bits, m.group_size)]
    for linear in linears:
        linear.int8_activations = True
    return len(linears)


def quantize_linears(model: nn.Module, bits: int, group_size: int = 32) -> int:
    """--quantization int8|int4: every float nn.Linear under model becomes a GroupQuantLinear, in place
    (a tied lm_head gets its own quantized copy; the embedding lookup keeps its floats). Returns how many."""
    return replace_linears(model, lambda linear: GroupQuantLinear(
        quantize_weight(linear.weight, bits, group_size), None if linear.bias is None else linear.bias.detach().float()))


def weight_formats(model: nn.Module) -> str:
    """What the linears run in, for model info: e.g. "Q4_1, Q8_0" or "int4 (quantized at load)"; "" when
    every linear holds floats."""
    formats = {m.source for m in model.modules() if isinstance(m, GroupQuantLinear | GroupQuantEmbedding)}
    formats |= {"int8 (per channel)" for m in model.modules() if isinstance(m, Int8Linear)}
    # GGML block linears and embeddings (worker.linears.ggml_blocks): the file's own types
    formats |= {part.type_name for m in model.modules() if hasattr(m, "weight_blocks") for part in m.weight_blocks.parts}
    # a mixture of experts' stacked experts (worker.model.moe) stay in the model dtype whatever the linears run in,
    # or in a GGUF file's own blocks (worker.linears.ggml_experts)
    experts = {str(m.gate_up.dtype).removeprefix("torch.") for m in model.modules() if isinstance(
        getattr(m, "gate_up", None), nn.Parameter)}
    on_blocks = {part.type_name for m in model.modules() for weight in getattr(m, "expert_blocks", ()) for part in weight.parts}
    experts |= on_blocks
    if (formats or on_blocks) and experts:  # e.g. "Q4_K, Q6_K; experts Q4_K, Q6_K", "experts Q8_0" (float linears)
        return "; ".join(filter(None, (", ".join(sorted(formats)), f"experts {', '.join(sorted(experts))}")))
    return ", ".join(sorted(formats))
