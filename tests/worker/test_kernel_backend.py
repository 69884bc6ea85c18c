"""The Triton backend (run by the Triton interpreter on CPU) against the torch backend on one random tiny
model: same greedy tokens and the same logprobs over a chunked prefill, a mixed prefill+decode step and
decode-only steps (the decode kernel), for three requests with different block tables."""
from __future__ import annotations

import pytest
import torch

from scheduler.plan import CachedRequestData, NewRequestData, StepPlan
from scheduler.request import SamplingParams
from tests.gpu.random_model import random_llama, tiny_config
from worker.backends import ExecutionOptions
from worker.model_runner import ModelRunner

WITH_LOGPROBS = SamplingParams(temperature=0.0, logprobs=3, max_tokens=64)
BLOCK_SIZE = 4


def run_steps(runner: ModelRunner) -> list[dict]:
    """Returns, per step, {request id: (token, chosen logprob, top-3)}."""
    a, b, c = list(range(3, 16)), [40, 41, 42, 43, 44, 45], [7, 100, 9, 200, 11]
    new = {
        "a": NewRequestData("a", a, len(a), WITH_LOGPROBS, [9, 2, 5, 14, 1], 0),
        "b": NewRequestData("b", b, len(b), WITH_LOGPROBS, [3, 11, 6], 0),
        "c": NewRequestData("c", c, len(c), WITH_LOGPROBS, [8, 12, 4], 0),
    }
    plans = [
        StepPlan(1, [new["a"], new["b"]], num_scheduled_tokens={"a": 10, "b": 6}),  # a: first chunk; b: whole prompt
        StepPlan(2, [new["c"]], [CachedRequestData("a", [], 10), CachedRequestData("b", [], 6)],
                 num_scheduled_tokens={"b": 1, "a": 3, "c": 5}),  # mixed: decode, prefix chunk, fresh prompt
    ]
    outputs = [runner.execute(plan) for plan in plans]
    for step in range(3, 6):  # decode-only steps
        cached = [CachedRequestData(rid, [], runner.requests[rid].num_computed_tokens) for rid in ("a", "b", "c")]
        outputs.append(runner.execute(StepPlan(step, cached_requests=cached, num_scheduled_tokens={"a": 1, "b": 1, "c": 1})))
    return [{rid: (token, out.logprobs[rid].logprob, out.logprobs[rid].top) for rid, token in out.sampled_token_ids.items()}
            for out in outputs]


@pytest.fixture(scope="module")
def model_and_config():
    config = tiny_config(num_layers=2)
    return random_llama(config, torch.float32, "cpu", seed=3, std=0.2), config


def test_triton_backend_matches_torch_backend(model_and_config):
    model, config = model_and_config
    runners = {
        backend: ModelRunner(model, config, num_blocks=16, block_size=BLOCK_SIZE, dtype=torch.float32,
                             options=ExecutionOptions(kernel_backend=backend))
        for backend in ("torch", "triton")
    }
    assert runners["triton"].kernel_path is not None and runners["torch"].kernel_path is None
    expected, actual = run_steps(runners["torch"]), run_steps(runners["triton"])
    assert [sorted(step) for step in actual] == [["b"], ["a", "b", "c"], ["a", "b", "c"], ["a", "b", "c"], ["a", "b", "c"]]
    for step_expected, step_actual in zip(expected, actual):
        for rid, (token, logprob, top) in step_expected.items():
            assert step_actual[rid][0] == token
            assert step_actual[rid][1] == pytest.approx(logprob, abs=1e-4)
            assert [t for t, _ in step_actual[rid][2]] == [t for t, _ in top]
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
