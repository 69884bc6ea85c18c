"""CUDA-only parts of issue 19: the swap tier's pinned host pages and copy stream, a swapped request's
greedy output on the Triton path, and the KV cache sized from free device memory after a measured
activation peak. Skipped without CUDA; tests/gpu/run.sh runs them on the device machine."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.engine import EngineCore
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.gpu.random_model import random_llama, tiny_config
from worker.kv_sizing import measure_activation_peak, profile_batch, size_from_free_memory
from worker.memory import free_memory_bytes
from worker.model.kv_cache import HostSwapSpace, allocate_kv_cache, bytes_per_block
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only paths; run by tests/gpu/run.sh")
CUDA = torch.device("cuda")
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model_and_config():
    config = tiny_config(num_layers=2)
    return random_llama(config, torch.float32, CUDA, seed=5, std=0.2), config


def test_host_pages_are_pinned_and_copies_follow_the_compute_stream(model_and_config):
    _, config = model_and_config
    cache = allocate_kv_cache(config, 8, BLOCK_SIZE, torch.float32, CUDA)
    swap = HostSwapSpace(cache, 4)
    assert swap.storage.is_pinned() and swap.copy_stream is not None
    # a long compute-stream write just before the copy: the copy stream must wait for it
    cache.storage[:, :, 2].copy_(torch.randn_like(cache.storage[:, :, 2]).mul_(3).add_(1))
    written = cache.storage[:, :, 2].clone()
    swap.copy([(2, 1)], [(5, 1)])  # out and back within one plan: swap_out lands first
    torch.cuda.synchronize()
    assert torch.equal(swap.storage[1], written.cpu()) and torch.equal(cache.storage[:, :, 5], written)


def run_engine(model, config, num_blocks, num_host_blocks):
    runner = ModelRunner(model, config, num_blocks=num_blocks, block_size=BLOCK_SIZE, dtype=torch.float32,
                         options=WorkerOptions(graph_batch_sizes=(1, 2, 4)), num_host_blocks=num_host_blocks)
    runner.warm_up()
    scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=64,
                                          max_model_len=256, num_host_blocks=num_host_blocks,
                                          bytes_per_block=bytes_per_block(config, torch.float32, BLOCK_SIZE)))
    engine = EngineCore(scheduler, runner)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = [Request(f"r{i}", [(5 * i + j) % 100 + 3 for j in range(6 + 4 * i)], params) for i in range(6)]
    engine.run_to_completion(requests)
    return scheduler, [request.output_token_ids for request in requests]


def test_swapped_requests_keep_their_greedy_output_on_cuda(model_and_config):
    model, config = model_and_config
    _, expected = run_engine(model, config, num_blocks=128, num_host_blocks=0)
    scheduler, got = run_engine(model, config, num_blocks=14, num_host_blocks=64)
    assert scheduler.num_swapped_preemptions > 0
    assert got == expected


def test_cache_sized_from_free_device_memory(model_and_config):
    model, config = model_and_config
    probe = ModelRunner(model, config, num_blocks=128, block_size=BLOCK_SIZE, dtype=torch.float32)
    peak = measure_activation_peak(probe.execution_path, profile_batch(512, BLOCK_SIZE), CUDA)
    assert peak > 512 * config.hidden_size * 4  # at least one [T, hidden] float32 activation
    free = free_memory_bytes(CUDA)
    sizing = size_from_free_memory(free, peak, 0.5, bytes_per_block(config, torch.float32, BLOCK_SIZE), CUDA)
    assert 0 < sizing.kv_cache_bytes <= 0.5 * (free - peak) and "on cuda" in sizing.reason
