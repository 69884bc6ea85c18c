"""The device benchmark's own code, on a tiny model on the CPU, so that tests/gpu/run.sh cannot rot where
there is no GPU. The Triton path it drives on the device is checked by tests/worker/paths/test_kernel_backend.py."""
from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.bench_decode import main


def test_dry_run_measures_every_setting(tmp_path):
    output = tmp_path / "bench.json"
    rows = main(["--dry-run", "--kernel-backend", "torch", "--output", str(output)])
    # 2 batch sizes x 4 (graphs, overlap) settings, the first also with async scheduling; on CPU graphs
    # and overlap resolve off but every setting still runs
    assert [(row.batch_size, row.cuda_graphs, row.stream_overlap) for row in rows] == [(b, False, False) for b in (1, 3)] * 5
    assert [row.async_scheduling for row in rows] == [False] * 2 + [True] * 2 + [False] * 6
    assert all(row.step_ms > 0 and row.tokens_per_s > 0 and row.bytes_per_step > 0 for row in rows)
    saved = json.loads(output.read_text())
    assert saved["copy_gb_s"] > 0 and len(saved["rows"]) == 10


def test_dry_run_with_group_quantized_linears(tmp_path):
    output = tmp_path / "bench.json"
    dense = main(["--dry-run", "--kernel-backend", "torch", "--settings", "default"])
    rows = main(["--dry-run", "--kernel-backend", "torch", "--settings", "default", "--quantization", "int4",
                 "--output", str(output)])
    assert json.loads(output.read_text())["quantization"] == "int4"
    # 4-bit codes plus a float32 scale and min per 32 weights: ~5 bits a weight against float32's 32
    assert rows[0].bytes_per_step < dense[0].bytes_per_step / 3


def test_swap_benchmark_dry_run_compares_the_three_modes(tmp_path):
    from tests.gpu.bench_swap import main as bench_swap

    results = bench_swap(["--dry-run", "--kernel-backend", "torch", "--output", str(tmp_path / "swap.json")])
    assert list(results) == ["swap", "swap-always", "recompute", "static"]
    assert results["swap-always"]["swapped"] == results["swap-always"]["preemptions"] > 0
    assert results["recompute"]["swapped"] == 0
    assert all(row["tokens_per_s"] > 0 and row["step_p99_ms"] >= row["step_p50_ms"] for row in results.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton takes CPU tensors only under the interpreter, which a "
                    "CUDA machine runs without; tests/gpu/run.sh runs the real benchmark there")
def test_group_quant_benchmark_dry_run_checks_and_ranks(tmp_path):
    from tests.gpu.bench_group_quant import main as bench_group_quant

    results = bench_group_quant(["--dry-run", "--output", str(tmp_path / "gq.json")])
    assert results["best_gemv_config"] and [row["rows"] for row in results["table"]] == [1, 3]
    assert results["best_dequant_config"] and all("dequant_us" in row for row in results["table"])
    assert json.loads((tmp_path / "gq.json").read_text())["best_gemv_config"] == results["best_gemv_config"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton takes CPU tensors only under the interpreter, which a "
                    "CUDA machine runs without; tests/gpu/run.sh runs the real benchmark there")
def test_fused_moe_benchmark_dry_run_checks_both_paths(tmp_path):
    from tests.gpu.bench_fused_moe import main as bench_fused_moe

    output = tmp_path / "moe.json"
    rows = bench_fused_moe(["--dry-run", "--output", str(output)])
    assert [row["tokens"] for row in rows] == [1, 16]
    # the interpreter rounds to bfloat16 toward zero (bench_fused_moe: max_error)
    assert all(row["fused_error"] < 3e-2 and row["torch_error"] < 1e-2 and row["experts_read"] >= 2 for row in rows)
    assert json.loads(output.read_text())["shape"]["top_k"] == 2
