"""Linears on a GGUF file's quantized blocks exactly as the file stores them (issue 34): no conversion and
no copy at load, the weight being the file's own mapped pages, and integer dot products against 8-bit
activations (worker/csrc/ggml_blocks_dot.cpp, as llama.cpp's CPU backend computes them).

Why a second quantized format beside worker.linears.group_quant: that one unpacks every K-quant into
one byte or half a byte a code plus a float scale and minimum per 16 or 32 values, so a Q4_K_M file
grows by half at load (Q6_K more than doubles), and a decode step reads that much more. Here a step reads
the file's 4.5-6.6 bits a weight. The types with a kernel are BLOCK_TYPES; a tensor in another type
keeps the group_quant conversion (the loader decides, per tensor).

Accuracy: activations are rounded to int8 per 256 values (llama.cpp's q8_K), the error `tokenmill
accuracy` measures (docs/models.md); the weights are exact.

On a CPU whose auto path is the AVX2 GEMM, the loader then repacks the K-quant linears once into groups of 8 rows
(worker.linears.ggml_repack): a part with `repacked` set holds that layout, which only the GEMM reads (and the
dequantizer, row by row); the file's pages of those tensors are let go.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from worker.linears.dense_linear import dense_linear
from worker.linears.group_quant import DENSE_ROWS
from worker.native_ops import cpu_has_native_bf16, cpu_ops_available

# gguf's GGMLQuantizationType values of the types the compiled kernels run, and their block shapes
BLOCK_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
               "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23}
BLOCK_ELEMENTS = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "Q2_K": 256, "Q3_K": 256, "Q4_K": 256,
                  "Q5_K": 256, "Q6_K": 256, "IQ4_NL": 32, "IQ4_XS": 256}
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34, "Q2_K": 84, "Q3_K": 110, "Q4_K": 144,
               "Q5_K": 176, "Q6_K": 210, "IQ4_NL": 18, "IQ4_XS": 136}
# Up to this many rows of x the integer-dot kernel runs; past it, dequantized strips and a GEMM each
# (GGMLBlocksLinear.forward_strips). Qwen2.5-1.5B's layer (qkv, o, gate_up, down), 2 threads, Sapphire
# Rapids (AMX), ms, dot / strips (scripts/bench_ggml_blocks.py): 1 row 1.24 / 11.2, 16 rows 8.5 / 11.6,
# 32 rows 17.0 / 12.9, 128 rows 64 / 22, 512 rows 364 / 38. (A dense bfloat16 copy would take 3.1-3.7 ms at
# 1-32 rows: it wins from a few rows but holds 2 bytes a weight, 3x the file; see docs/models.md.)
DOT_ROWS = 24
# With AMX-INT8 the K-quants run on tiles from 6 rows (worker/csrc/ggml_blocks_amx.cpp), and the strips only
# won past ~128 rows. The same layer, ms, tiles / strips: 16 rows 3.28 / 14.3, 32 rows 5.8 / 15.7, 64 rows
# 11.3 / 20.1, 128 rows 24.3 / 23.9. With AMX-BF16 the "strips" are the bfloat16 tiles on 32 dequantized weight
# rows at a time (worker/csrc/ggml_blocks_amx_bf16.cpp), which tie the INT8 tiles at 64 rows and win past it: the
# same layer, 2 threads, Xeon with AMX (2026-12-07), ms, INT8 tiles / bfloat16 tiles / the strips through oneDNN:
# 48 rows 7.7 / 8.1 / 18.2, 64 rows 10.2 / 10.3 / 19.1, 96 rows 15.4 / 12.3 / 21.4, 128 rows 19.4 / 12.7 / 22.3,
# 256 rows 37.9 / 20.6 / 24.6; medians of 12 alternated calls, bfloat16 tiles / oneDNN strips: 128 rows 0.67x,
# 256 rows 0.84x, 384 rows 0.87x, 512 rows 0.97x.
AMX_DOT_ROWS = 64
AMX_MIN_ROWS = 6  # worker/csrc/ggml_blocks_dot.cpp's kAmxMinRows: the row count auto takes the tiles from
# On an AVX2-only CPU the K-quants run a register-blocked integer GEMM (worker/csrc/ggml_blocks_avx2_gemm.cpp)
# from AVX2_GEMM_MIN_ROWS rows (ggml_blocks.h's kAvx2GemmMinRows), and the float32 strips (scalar dequantizing,
# then sgemm) never caught up with it: the same layer, 1 thread, AMD EPYC (Zen 3, AVX2 only), CPU ms, GEMM /
# strips: 16 rows 11.1 / 69.7, 32 rows 21.0 / 87.5, 64 rows 42.7 / 125, 128 rows 82 / 181, 512 rows 523 / 704. Strips only past
# this many rows (a long prefill), where their float activations are the more exact.
AVX2_GEMM_DOT_ROWS = 512
AVX2_GEMM_MIN_ROWS = 1  # one sequence's decode too: docs/benchmarks.md (60 vs 69 ms a token, 1.5B Q4_K_M)
STRIP_BYTES = 4 * 2**20  # a dequantized strip's most
# worker/csrc/ggml_blocks.h's kRepacked: added to a K-quant's type, the part is in worker/csrc/ggml_blocks_repack.cpp's
# layout (8 rows' blocks interleaved), whose bytes a row are these per 256 values
REPACKED = 256
REPACKED_BYTES = {"Q4_K": 148, "Q5_K": 180, "Q6_K": 210}
# the instruction set the kernels use: 0 the best this CPU has (AMX-INT8 tiles for Q4_K, Q5_K, Q6_K from a few
# rows, else AVX-512 VNNI, else AVX2 with its GEMM for the K-quants at any row count up to AVX2_GEMM_DOT_ROWS); tests force 1 / 2 / 3 / 4
KERNEL_PATHS = {"auto": 0, "avx2": 1, "avx512_vnni": 2, "amx_int8": 3, "avx2_gemm": 4}
# the vector kernels under each many-row path: what the deterministic mode runs, one kernel for every count
VECTOR_UNDER = {KERNEL_PATHS["amx_int8"]: KERNEL_PATHS["avx512_vnni"], KERNEL_PATHS["avx2_gemm"]: KERNEL_PATHS["avx2"]}


@functools.cache
def auto_path() -> int:
    """The path auto resolves to on this CPU (asked once; the compiled ops must be loaded)."""
    return torch.ops.tokenmill.ggml_blocks_path(KERNEL_PATHS["auto"])


@functools.cache
def amx_bf16_usable() -> bool:
    """Whether this CPU multiplies bfloat16 on AMX tiles and Linux gave this process their state (asked once; the
    compiled ops must be loaded): then a many-row step's strips run on the tiles (ggml_blocks_amx_bf16.cpp)."""
    return torch.ops.tokenmill.ggml_blocks_amx_bf16()


def vector_path() -> int:
    """The vector kernels' path on this CPU (auto without the AMX tiles or the AVX2 GEMM): what the
    deterministic mode runs."""
    return VECTOR_UNDER.get(auto_path(), auto_path())


def dot_rows() -> int:
    """Up to this many rows of x the integer kernels run, past it the dequantized strips."""
    return {KERNEL_PATHS["amx_int8"]: AMX_DOT_ROWS, KERNEL_PATHS["avx2_gemm"]: AVX2_GEMM_DOT_ROWS}.get(auto_path(), DOT_ROWS)


# --cpu-block-kernels auto: the K-quants, whose conversion grows most (Q6_K more than doubles) and whose
# int8 activations are what llama.cpp itself runs them with, and the types group_quant has no layout for
# (Q2_K, Q3_K, IQ4_NL, IQ4_XS), which without a kernel are dequantized to --dtype at load (3.6-6x the file's
# bytes in bfloat16). Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 join under `all`: a file like the default model's (Q4_1 with
# Q8_0) keeps its float activations, and its outputs, unless asked.
AUTO_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"})


def block_types(mode: str) -> frozenset[str]:
    """The GGML types --cpu-block-kernels runs on blocks (worker.options.CPU_BLOCK_KERNEL_MODES)."""
    return {"auto": AUTO_TYPES, "all": frozenset(BLOCK_TYPES), "off": frozenset()}[mode]


def block_supported(type_name: str, in_features: int) -> bool:
    return type_name in BLOCK_TYPES and in_features % BLOCK_ELEMENTS[type_name] == 0


def mapped_bytes_tensor(array: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over array's memory without a copy. The file is mapped read-only and nothing writes
    these weights, so torch's warning about a read-only buffer does not apply."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


@dataclass(frozen=True, slots=True)
class BlockPart:
    """Rows of one weight in one GGML type: blocks [rows, in_features / elements * bytes] uint8, the file's
    blocks, or with repacked the same values in the AVX2 GEMM's layout (REPACKED_BYTES a row per 256 values)."""
    type_name: str
    blocks: torch.Tensor
    repacked: bool = False

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    @property
    def type_id(self) -> int:
        """What the compiled ops take as its type."""
        return BLOCK_TYPES[self.type_name] + (REPACKED if self.repacked else 0)

    def row_bytes(self, in_features: int) -> int:
        per_block = REPACKED_BYTES[self.type_name] if self.repacked else BLOCK_BYTES[self.type_name]
        return in_features // BLOCK_ELEMENTS[self.type_name] * per_block


class PartsOfBlocks:
    """What a weight held as parts of GGML blocks (parts, in_features) offers whatever its leading dims: the
    check of each part against the kernels and its row bytes, its bytes and its formats."""

    __slots__ = ()
    parts: tuple[BlockPart, ...]
    in_features: int

    def _check_parts(self, what: str, leading: tuple[str, ...]) -> None:
        """what: "" or "expert "; leading: the names of the dims before a row's bytes ("rows",)."""
        for part in self.parts:
            if not block_supported(part.type_name, self.in_features):
                raise ValueError(f"{part.type_name} {what}blocks of {self.in_features} values a row have no kernel "
                                 f"(types {sorted(BLOCK_TYPES)}, rows a multiple of the block)")
            rows = part.blocks.shape[-2] if part.blocks.dim() > 1 else 0  # an expert's, for stacked experts
            if part.repacked and (part.type_name not in REPACKED_BYTES or rows % 8):
                raise ValueError(f"a repacked {part.type_name} {what}part of {rows} rows: only "
                                 f"{sorted(REPACKED_BYTES)} repack, in groups of 8 rows")
            row_bytes = part.row_bytes(self.in_features)
            blocks = part.blocks
            if blocks.dtype != torch.uint8 or blocks.dim() != len(leading) + 1 or blocks.shape[-1] != row_bytes:
                raise ValueError(f"{part.type_name} {what}blocks must be uint8 [{', '.join(leading)}, {row_bytes}] "
                                 f"for {self.in_features} values a row, got {blocks.dtype} {tuple(blocks.shape)}")

    @property
    def nbytes(self) -> int:
        return sum(part.blocks.numel() for part in self.parts)

    @property
    def formats(self) -> str:
        return ", ".join(dict.fromkeys(part.type_name for part in self.parts))


@dataclass(frozen=True, slots=True)
class GGMLBlocksWeight(PartsOfBlocks):
    """A weight of out_features rows held as one or more parts, each in its file's own type (a fused q/k/v
    of a Q4_K_M file is Q4_K, Q4_K and Q6_K): the parts' rows follow each other."""
    parts: tuple[BlockPart, ...]
    in_features: int

    def __post_init__(self) -> None:
        self._check_parts("", ("rows",))

    @staticmethod
    def from_blocks(type_name: str, blocks: np.ndarray | torch.Tensor, out_features: int, in_features: int) -> GGMLBlocksWeight:
        tensor = blocks if isinstance(blocks, torch.Tensor) else mapped_bytes_tensor(blocks)
        return GGMLBlocksWeight((BlockPart(type_name, tensor.reshape(out_features, -1)),), in_features)

    @property
    def out_features(self) -> int:
        return sum(part.rows for part in self.parts)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [len(rows) or out_features, in_features], exactly gguf-py's values."""
        if rows is not None:
            if len(self.parts) != 1:
                raise ValueError("row lookups are for one-part weights (an embedding)")
            part = self.parts[0]
            return torch.ops.tokenmill.ggml_blocks_dequantize(part.blocks, part.type_id, self.in_features, rows)
        return torch.cat([torch.ops.tokenmill.ggml_blocks_dequantize(
            part.blocks, part.type_id, self.in_features, torch.arange(part.rows)) for part in self.parts])

    def rows(self, index: torch.Tensor) -> GGMLBlocksWeight:
        """These rows, in this order (a copy: llama's q/k rows un-permuted); one-part weights."""
        if len(self.parts) != 1:
            raise ValueError("row selection is for one-part weights")
        part = self.parts[0]
        if part.repacked:
            raise ValueError("row selection is for the file's own blocks, not repacked ones")
        return GGMLBlocksWeight((BlockPart(part.type_name, part.blocks.index_select(0, index)),), self.in_features)

    @staticmethod
    def concat_rows(weights: list[GGMLBlocksWeight]) -> GGMLBlocksWeight:
        if len({w.in_features for w in weights}) != 1:
            raise ValueError(f"fused parts disagree on in_features: {[w.in_features for w in weights]}")
        return GGMLBlocksWeight(tuple(part for w in weights for part in w.parts), weights[0].in_features)


class CpuOnlyBlocks(nn.Module):
    """A module on a file's GGML blocks: their kernels run on CPU only, so a move to another device is refused,
    naming what the loader does for one instead (refusal ends with "for", the device follows)."""

    refusal = ""

    def _apply(self, fn, recurse: bool = True):
        probe = fn(torch.empty(0, dtype=torch.uint8))
        if probe.device.type != "cpu":
            raise ValueError(f"{self.refusal} {probe.device.type}")
        return super()._apply(fn, recurse)


class GGMLBlocksLinear(CpuOnlyBlocks):
    """y = x W^T + b on W's blocks. x: [T, K] float32 or bfloat16 -> [T, N] in x's dtype."""

    refusal = ("GGML block linears run on CPU only; the loader converts a GGUF file's weights "
               "(worker.loader.gguf_quants) for")
    kernel_path = KERNEL_PATHS["auto"]  # tests set a forced instruction set on an instance

    def __init__(self, weight: GGMLBlocksWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if not cpu_ops_available():
            raise RuntimeError("GGML block linears need the compiled CPU ops (scripts/build_cpu_ops.py)")
        self.weight_blocks = weight
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self._blocks = [part.blocks for part in weight.parts]
        self._types = [part.type_id for part in weight.parts]
        self.repacked = any(part.repacked for part in weight.parts)
        self.register_buffer("bias", bias, persistent=False)
        # --cpu-dense-weights on only (worker.linears.dense_weights): 2 bytes a weight beside the file's ~0.6
        self.register_buffer("dense_weight", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, K] -> [T, N]
        rows, dense = x.shape[0], self.dense_weight
        if dense is not None and rows >= DENSE_ROWS and x.dtype is dense.dtype:
            out = dense_linear(x, dense)  # --cpu-dense-weights on: a copy kept for many-row steps
            return out if self.bias is None else out.add_(self.bias)
        if rows > dot_rows():
            return self.forward_strips(x)
        # auto: the vector kernel, or for Q4_K, Q5_K, Q6_K from a few rows AMX tiles where the CPU has them, else
        # on an AVX2-only CPU the AVX2 GEMM (on the repacked parts where the loader repacked them)
        return torch.ops.tokenmill.ggml_blocks_linear(x, self._blocks, self._types, self.kernel_path, self.bias)

    def weight_view(self) -> GGMLBlocksWeight:  # what worker.linears.dense_weights dequantizes
        return self.weight_blocks

    def forward_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The integer-dot kernel whatever the row count, on one instruction set for every count: a row's
        output is the same bits alone or among others (the deterministic mode runs only this). Under auto
        that is the vector kernel (AMX tiles or the AVX2 GEMM would take over from a few rows, summing in another
        order); a forced path is kept. Repacked parts only run on the AVX2 GEMM, which sums each row alone too
        (the deterministic mode keeps the file's blocks: the loader repacks only without it)."""
        path = self.kernel_path or (KERNEL_PATHS["avx2_gemm"] if self.repacked else vector_path())
        # the op adds the bias and writes x's dtype itself: ~113 calls a decode step, two ops fewer each
        return torch.ops.tokenmill.ggml_blocks_linear(x, self._blocks, self._types, path, self.bias)

    def forward_strips(self, x: torch.Tensor) -> torch.Tensor:
        """Many rows (a prefill): the weight dequantized, multiplied in bfloat16 where the CPU does so natively
        (float32 otherwise): past dot_rows() rows the integer kernel's arithmetic costs more than dequantizing the
        whole weight once. On AMX-BF16 CPUs 32 rows at a time into a scratch the tiles read
        (ggml_blocks_amx_bf16.cpp: the same values, no strip through memory, no oneDNN packing per strip)."""
        if amx_bf16_usable() and not self.repacked:
            return torch.ops.tokenmill.ggml_blocks_linear_bf16_tiles(x, self._blocks, self._types, self.bias)
        return self.forward_dequantized_strips(x)

    def forward_dequantized_strips(self, x: torch.Tensor) -> torch.Tensor:
        """forward_strips through torch: strips of the weight dequantized in cache, one GEMM each (bfloat16 where
        the CPU multiplies it natively, oneDNN; float32 otherwise)."""
        dtype = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        xs = x.to(dtype)
        out = torch.empty(x.shape[0], self.out_features, dtype=dtype)
        column = 0
        for part, block in zip(self.weight_blocks.parts, self._types):
            step = max(16, STRIP_BYTES // (self.in_features * xs.element_size()) // 16 * 16)
            for row0 in range(0, part.rows, step):
                row1 = min(part.rows, row0 + step)
                if dtype == torch.bfloat16:
                    strip = torch.ops.tokenmill.ggml_blocks_dequantize_bf16(part.blocks, block, self.in_features, row0, row1)
                else:
                    strip = torch.ops.tokenmill.ggml_blocks_dequantize(part.blocks, block, self.in_features,
                                                                      torch.arange(row0, row1))
                out[:, column + row0:column + row1] = F.linear(xs, strip)
            column += part.rows
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, formats={self.weight_blocks.formats}"


class GGMLBlocksEmbedding(nn.Module):
    """The embedding on its blocks: a lookup dequantizes just the rows it reads."""

    def __init__(self, weight: GGMLBlocksWeight, dtype: torch.dtype) -> None:
        super().__init__()
        if len(weight.parts) != 1:
            raise ValueError("an embedding is one tensor of one type")
        self.weight_blocks, self.dtype = weight, dtype
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.weight_blocks.dequantize(input_ids.reshape(-1)).to(self.dtype).reshape(*input_ids.shape, -1)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.weight_blocks.formats}"


def describe_block_kernels(model: nn.Module) -> str | None:
    """The kernel the model's block linears run, chosen once from the CPU's flags, for the worker's log;
    None without block linears."""
    linears = [m for m in model.modules() if isinstance(m, GGMLBlocksLinear)]
    if not linears:
        return None
    names = {value: name for name, value in KERNEL_PATHS.items()}
    types = sorted({part.type_name for m in linears for part in m.weight_blocks.parts})
    mapped = sum(m.weight_blocks.nbytes for m in linears) / 2**20
    repacked = sum(m.repacked for m in linears)
    vector = names[vector_path()]
    tiles = {KERNEL_PATHS["amx_int8"]: f" (AMX-INT8 tiles for Q4_K, Q5_K, Q6_K from {AMX_MIN_ROWS} rows)",
             KERNEL_PATHS["avx2_gemm"]: f" (an AVX2 GEMM for Q4_K, Q5_K, Q6_K, {AVX2_GEMM_MIN_ROWS}-{AVX2_GEMM_DOT_ROWS} rows)"
             }.get(auto_path(), "")
    where = f"GGML blocks, {repacked} of them repacked at load for the GEMM" if repacked else "the file's own blocks"
    return (f"{len(linears)} linears on {where} ({', '.join(types)}, {mapped:.0f} MiB): {vector} integer "
            f"dot products{tiles} on activations rounded to int8 per 256 values up to {dot_rows()} rows, "
            f"{past_dot_rows()} past that")


def past_dot_rows() -> str:
    """What a step of more than dot_rows() rows runs on this CPU (forward_strips), for the worker's log."""
    if amx_bf16_usable():
        return "AMX-BF16 tiles on 32 weight rows at a time dequantized to bfloat16"
    return f"dequantized {'bfloat16' if cpu_has_native_bf16() else 'float32'} strips"


def block_weight_bytes(model: nn.Module) -> int:
    """The bytes of the model's block weights (each tied set once), in the file's layout or repacked."""
    return sum(weight.nbytes for weight in block_weights(model))


def mapped_weight_bytes(model: nn.Module) -> int:
    """The bytes of the model's block weights in the file's own layout (each tied set once). Mapped from the file,
    they sit in the page cache, which MemAvailable counts as free: the KV cache's sizing takes them off, or it
    would claim the memory the weights need and every step would read them from disk again. Repacked parts are
    process memory, which MemAvailable has already taken off."""
    return sum(part.blocks.numel() for weight in block_weights(model) for part in weight.parts if not part.repacked)


def fault_in(model: nn.Module) -> int:
    """Reads one byte of every page of the model's block weights, so the file is resident before the worker
    measures anything: the profile pass's peak (VmHWM) would otherwise count the pages it faults in as
    activations (4.1 GiB of a Llama-3.1-8B-shaped file), and the first request would wait on the disk.
    Returns the bytes walked."""
    weights = block_weights(model)
    for weight in weights:
        for part in weight.parts:
            part.blocks.reshape(-1)[::4096].sum()  # one byte a page
    return sum(weight.nbytes for weight in weights)


def block_weights(model: nn.Module) -> list[GGMLBlocksWeight]:
    """The model's block weights, each once (a tied embedding and lm_head share one), and a mixture of experts'
    stacked expert blocks (worker.linears.ggml_experts: `expert_blocks`)."""
    found = {id(m.weight_blocks): m.weight_blocks for m in model.modules() if hasattr(m, "weight_blocks")}
    found.update((id(weight), weight) for m in model.modules() for weight in getattr(m, "expert_blocks", ()))
    return list(found.values())
