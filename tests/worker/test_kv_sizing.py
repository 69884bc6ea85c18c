"""The KV cache sized from the memory there is (--kv-cache-memory-fraction), a fixed budget still overriding,
and the host swap tier's page copies."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams
from core.step import NewRequestData, StepPlan
from tests.helpers.tiny_models import make_tiny_hf_model
from worker.build import build_sized_runner
from worker.kv_sizing import size_from_free_memory
from worker.memory import free_memory_bytes
from worker.model.kv_cache import bytes_per_block
from worker.options import WorkerOptions

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder, _ = make_tiny_hf_model(tmp_path_factory.mktemp("sizing"), "llama_gqa")
    return folder


def test_fraction_of_free_memory_after_the_activation_peak():
    sizing = size_from_free_memory(free_bytes=1000 * 2**20, activation_peak=200 * 2**20, fraction=0.5,
                                   bytes_per_block=2**20, device=torch.device("cpu"))
    assert sizing.num_blocks == 400 and sizing.kv_cache_bytes == 400 * 2**20
    assert "0.5 x (1000 MiB free on cpu" in sizing.reason and "200.0 MiB activation peak" in sizing.reason
    with pytest.raises(ValueError, match="no page"):
        size_from_free_memory(2**20, 2**20, 0.9, 1024, torch.device("cpu"))
    with pytest.raises(ValueError, match="kv_cache_memory_fraction=1.5"):
        size_from_free_memory(2**30, 0, 1.5, 1024, torch.device("cpu"))


def test_cpu_cache_takes_the_fraction_of_available_ram(tiny_folder):
    fraction = 1e-4
    available = free_memory_bytes(torch.device("cpu"))
    runner, sizing = build_sized_runner(WorkerOptions(
        model=str(tiny_folder), dtype="float32", block_size=BLOCK_SIZE, device="cpu", kv_cache_memory_fraction=fraction,
        max_num_batched_tokens=256), progress=False)
    per_block = bytes_per_block(runner.model_config, torch.float32, BLOCK_SIZE)
    assert runner.num_blocks == sizing.num_blocks and sizing.kv_cache_bytes == sizing.num_blocks * per_block
    # MemAvailable moves with the rest of the machine: within 20% of the fraction measured here
    assert 0.8 * fraction * available <= sizing.kv_cache_bytes + per_block <= 1.2 * fraction * available
    assert f"{fraction:g} x (" in sizing.reason and "activation peak of the profile pass" in sizing.reason


def test_kv_cache_mb_overrides_the_fraction(tiny_folder):
    runner, sizing = build_sized_runner(WorkerOptions(
        model=str(tiny_folder), dtype="float32", block_size=BLOCK_SIZE, device="cpu", kv_cache_mb=1,
        kv_cache_memory_fraction=0.5), progress=False)
    per_block = bytes_per_block(runner.model_config, torch.float32, BLOCK_SIZE)
    assert runner.num_blocks == 2**20 // per_block and sizing.reason == "--kv-cache-mb 1"


def test_swapped_pages_come_back_bit_exact(tiny_folder):
    """The worker executes the plan's copies: out to the host tier, then back into other device pages."""
    runner, _ = build_sized_runner(WorkerOptions(
        model=str(tiny_folder), dtype="float32", block_size=4, device="cpu", num_blocks=8, swap_space_gb=64 / 1024),
        progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    runner.execute(StepPlan(0, new_requests=[NewRequestData("a", list(range(1, 9)), 8, params, [0, 1], 0)],
                            num_scheduled_tokens={"a": 8}))
    written = runner.kv_cache.storage[:, :, [0, 1]].clone()
    assert written.abs().sum() > 0
    runner.execute(StepPlan(1, new_requests=[NewRequestData("b", [5, 6, 7], 3, params, [2], 0)],
                            num_scheduled_tokens={"b": 3}, swap_out=[(0, 3), (1, 5)], finished_request_ids=["a"]))
    runner.kv_cache.storage[:, :, [0, 1]] = 0  # another request overwrites the device pages
    runner.execute(StepPlan(2, new_requests=[NewRequestData("c", [9], 1, params, [4], 0)],
                            num_scheduled_tokens={"c": 1}, swap_in=[(6, 3), (7, 5)]))
    assert torch.equal(runner.kv_cache.storage[:, :, [6, 7]], written)


_PEAKS_SCRIPT = """
import sys, torch
from worker.kv_sizing import measure_activation_peak, profile_batch
from worker.loader import load_model
from worker.model_runner import ModelRunner
model, config = load_model(sys.argv[1], progress=False)
for num_tokens in (16, 16, 4096):  # the first pass pays one-time costs (thread pools, kernels): not printed
    batch = profile_batch(num_tokens, int(sys.argv[2]))
    runner = ModelRunner(model, config, num_blocks=len(batch.spans[0].block_table), block_size=int(sys.argv[2]),
                         dtype=torch.float32)
    print(num_tokens, measure_activation_peak(runner.execution_path, batch, torch.device("cpu")))
"""


def test_cpu_activation_peak_is_measured(tiny_folder):
    """The profile pass's peak resident set above where it started: more tokens, more activation memory.

    Measured in a fresh process, as the worker does it at start: a long-lived process (this test run)
    keeps freed memory resident, and a forward pass reusing it does not raise the resident set."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _PEAKS_SCRIPT, str(tiny_folder), str(BLOCK_SIZE)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    peaks = {int(tokens): int(peak) for tokens, peak in (line.split() for line in result.stdout.splitlines())}
    # (the dict keeps the second 16-token pass: measured after the one-time costs, like the 4096 one)
    # 4096 tokens x the MLP's width in float32 alone is over 1 MiB
    assert peaks[4096] > 2**20 and peaks[4096] > peaks[16]