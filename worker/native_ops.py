"""Loads tokenmill's compiled CPU ops (worker/csrc, built by scripts/build_cpu_ops.py at install).

Loading never compiles: a serving process that finds no build (or a CPU without AVX2/FMA) uses torch's
own ops instead and says so once in its log, with the command that builds them.
"""
from __future__ import annotations

import hashlib
import logging
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "csrc" / "group_quant_linear.cpp", HERE / "csrc" / "group_quant_rows_bf16.cpp",
           HERE / "csrc" / "group_quant_int8_dot.cpp", HERE / "csrc" / "decoder_ops.cpp",
           HERE / "csrc" / "ggml_blocks_dot.cpp", HERE / "csrc" / "ggml_blocks_amx.cpp",
           HERE / "csrc" / "ggml_blocks_amx_bf16.cpp",
           HERE / "csrc" / "ggml_blocks_experts.cpp", HERE / "csrc" / "ggml_blocks_avx2_gemm.cpp",
           HERE / "csrc" / "ggml_blocks_repack.cpp", HERE / "csrc" / "kv_quant_ops.cpp")
HEADERS = (HERE / "csrc" / "simd.h", HERE / "csrc" / "ggml_blocks.h", HERE / "csrc" / "ggml_blocks_lowbit.h",
           HERE / "csrc" / "ggml_blocks_avx2_tile.h", HERE / "csrc" / "ggml_blocks_amx.h",
           HERE / "csrc" / "kv_quant.h")  # not compiled on their own, but part of what a build is built from
OPS_DIR = HERE / "_ops"
# -fopenmp: at::parallel_for is an inline OpenMP loop, serial without it (measured: the op ran on one of
# two threads); the .so then needs libgomp.so.1, which resolves to the copy torch already loaded
COMPILE_FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)


def built_library_path() -> Path:
    digest = hashlib.sha256(" ".join((torch.__version__, *COMPILE_FLAGS, *LINK_FLAGS)).encode())
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    return OPS_DIR / f"tokenmill_cpu_ops_{digest.hexdigest()[:12]}.so"


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


# CPU flags with native bfloat16 arithmetic; without them oneDNN emulates bfloat16 and it is slower
# than float32 (measured in issue 15 on AVX2: bfloat16 linears no faster, attention slower)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@cache
def cpu_has_native_bf16() -> bool:
    return any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)


def _cpu_has_avx2_fma() -> bool:
    return {"avx2", "fma"} <= cpu_flags()


@cache
def cpu_ops_available() -> bool:
    """True once torch.ops.tokenmill.group_quant_* are loaded (cached: one attempt, one log line)."""
    if not _cpu_has_avx2_fma():
        log.warning("compiled CPU ops not used: this CPU lacks AVX2/FMA; quantized linears use torch ops (slower)")
        return False
    if not all(source.exists() for source in (*SOURCES, *HEADERS)):
        log.warning("compiled CPU ops not used: their sources are not installed beside worker/ (%s)", HERE / "csrc")
        return False
    path = built_library_path()
    if not path.exists():
        log.warning("compiled CPU ops not built (%s missing): quantized linears use torch ops (slower); "
                    "build them with: .venv/bin/python scripts/build_cpu_ops.py", path.name)
        return False
    torch.ops.load_library(str(path))
    return True
