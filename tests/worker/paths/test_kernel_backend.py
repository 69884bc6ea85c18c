"""The Triton backend (run by the Triton interpreter on CPU) against the torch backend on one random tiny
model: same greedy tokens and the same logprobs over a chunked prefill, a mixed prefill+decode step and
decode-only steps (the decode kernel), for three requests with scattered block tables."""
from __future__ import annotations

import pytest
import torch

from core.step import CachedRequestData, NewRequestData, StepPlan
from core.sampling import SamplingParams
from tests.gpu.random_model import random_llama, tiny_config
from tests.gpu.steps import BLOCK_SIZE, NUM_BLOCKS, assert_same_steps, run_mixed_steps
from worker.options import WorkerOptions
from worker.model_runner import ModelRunner
from worker.paths.torch_path import TorchPath
from worker.paths.triton.path import TritonPath


@pytest.fixture(scope="module")
def model_and_config():
    config = tiny_config(num_layers=2)
    return random_llama(config, torch.float32, "cpu", seed=3, std=0.2), config


def test_triton_backend_matches_torch_backend(model_and_config):
    model, config = model_and_config
    runners = {
        backend: ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, dtype=torch.float32,
                             options=WorkerOptions(kernel_backend=backend))
        for backend in ("torch", "triton")
    }
    assert type(runners["triton"].execution_path) is TritonPath and type(runners["torch"].execution_path) is TorchPath
    expected, actual = run_mixed_steps(runners["torch"]), run_mixed_steps(runners["triton"])
    assert [sorted(step) for step in expected] == [["b"], ["a", "b", "c"], ["a", "b", "c"], ["a", "b", "c"], ["a", "b", "c"]]
    assert_same_steps(expected, actual, logprob_atol=1e-4)
    # the caches hold the same K/V in the pages the plans named (block 0 is nobody's)
    torch_cache, triton_cache = runners["torch"].kv_cache.storage, runners["triton"].kv_cache.storage
    torch.testing.assert_close(triton_cache[:, :, 1:], torch_cache[:, :, 1:], atol=1e-5, rtol=1e-5)


def test_triton_backend_warm_up_on_cpu_needs_no_cuda(model_and_config):
    model, config = model_and_config
    runner = ModelRunner(model, config, num_blocks=4, block_size=BLOCK_SIZE, dtype=torch.float32,
                         options=WorkerOptions(kernel_backend="triton"))
    runner.warm_up()
    # on CPU the CUDA-only parts resolve off and are never built
    path = runner.execution_path
    assert (path.stager, path.readback, path.graphs) == (None, None, None)


def generate(runner: ModelRunner, requests: dict[str, SamplingParams], num_steps: int) -> dict[str, list[int]]:
    """Each request: prompt [5, 6, 7, 8] in its own 4 pages, then num_steps - 1 decode steps; its sampled tokens."""
    new = [NewRequestData(rid, [5, 6, 7, 8], 4, params, [4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 4], 0)
           for i, (rid, params) in enumerate(requests.items())]
    out = runner.execute(StepPlan(1, new, num_scheduled_tokens={rid: 4 for rid in requests}))
    tokens = {rid: [out.sampled_token_ids[rid]] for rid in requests}
    for step in range(2, num_steps + 1):
        cached = [CachedRequestData(rid, [], runner.requests[rid].num_computed_tokens) for rid in requests]
        out = runner.execute(StepPlan(step, cached_requests=cached, num_scheduled_tokens={rid: 1 for rid in requests}))
        for rid in requests:
            tokens[rid].append(out.sampled_token_ids[rid])
    return tokens


def test_triton_backend_samples_on_the_device(model_and_config):
    model, config = model_and_config

    def runner(backend: str) -> ModelRunner:
        return ModelRunner(model, config, num_blocks=16, block_size=BLOCK_SIZE, dtype=torch.float32,
                           options=WorkerOptions(kernel_backend=backend))

    greedy = generate(runner("torch"), {"g": SamplingParams(temperature=0.0)}, 4)["g"]
    seeded = SamplingParams(temperature=1.5, top_p=0.9, seed=1234)
    alone = generate(runner("triton"), {"s": seeded}, 4)["s"]
    crowded = generate(runner("triton"), {"x": SamplingParams(temperature=2.0), "s": seeded,
                                          "k1": SamplingParams(temperature=0.7, top_k=1)}, 4)
    assert crowded["k1"] == greedy  # top-k 1 keeps only the argmax, whatever the temperature
    assert crowded["s"] == alone  # a seeded row's tokens ignore its neighbours (per-row seeds)
    assert all(0 <= t < config.vocab_size for t in crowded["x"])
