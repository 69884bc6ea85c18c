"""The Triton backend (run by the Triton interpreter on CPU) against the torch backend on one random tiny
model: same greedy tokens and the same logprobs over a chunked prefill, a mixed prefill+decode step and
decode-only steps (the decode kernel), for three requests with scattered block tables."""
from __future__ import annotations

import pytest
import torch

from tests.gpu.random_model import random_llama, tiny_config
from tests.gpu.steps import BLOCK_SIZE, NUM_BLOCKS, assert_same_steps, run_mixed_steps
from worker.backends import ExecutionOptions
from worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def model_and_config():
    config = tiny_config(num_layers=2)
    return random_llama(config, torch.float32, "cpu", seed=3, std=0.2), config


def test_triton_backend_matches_torch_backend(model_and_config):
    model, config = model_and_config
    runners = {
        backend: ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32,
                             options=ExecutionOptions(kernel_backend=backend))
        for backend in ("torch", "triton")
    }
    assert runners["triton"].kernel_path is not None and runners["torch"].kernel_path is None
    expected, actual = run_mixed_steps(runners["torch"]), run_mixed_steps(runners["triton"])
    assert [sorted(step) for step in expected] == [["b"], ["a", "b", "c"], ["a", "b", "c"], ["a", "b", "c"], ["a", "b", "c"]]
    assert_same_steps(expected, actual, logprob_atol=1e-4)
    # the caches hold the same K/V in the pages the plans named (block 0 is nobody's)
    torch_cache, triton_cache = runners["torch"].kv_cache.storage, runners["triton"].kv_cache.storage
    torch.testing.assert_close(triton_cache[:, :, 1:], torch_cache[:, :, 1:], atol=1e-5, rtol=1e-5)


def test_triton_backend_warm_up_on_cpu_needs_no_cuda(model_and_config):
    model, config = model_and_config
    runner = ModelRunner(model, config, num_blocks=4, block_size=BLOCK_SIZE, dtype=torch.float32,
                         options=ExecutionOptions(kernel_backend="triton"))
    runner.warm_up()
    # on CPU the CUDA-only parts resolve off and are never built
    assert (runner.kernel_path.stager, runner.kernel_path.readback, runner.kernel_path.graphs) == (None, None, None)
