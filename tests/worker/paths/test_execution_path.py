"""The worker's execution-path seam, driven directly (no runner): each backend builds its own path, both
satisfy the protocol, and through prepare/forward/sample the torch path and the Triton path (the Triton
interpreter on CPU) give the same logits and greedy tokens over a prefill step and a decode step."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams
from tests.gpu.random_model import random_llama, tiny_config
from worker.model.kv_cache import allocate_kv_cache
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions
from worker.paths import build_execution_path
from worker.paths.base import ExecutionPath, resolve_execution
from worker.paths.torch_path import TorchPath
from worker.paths.triton.path import TritonPath
from worker.sampling.sampler import SamplingRow
from worker.step_batch import RequestSpan, StepBatch

BLOCK_SIZE = 4
CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def paths():
    config = tiny_config(num_layers=2)
    model = random_llama(config, torch.float32, CPU, seed=5, std=0.2)
    built = {}
    for backend in ("torch", "triton"):
        execution = resolve_execution(WorkerOptions(kernel_backend=backend), CPU)
        kv_cache = allocate_kv_cache(config, 8, BLOCK_SIZE, torch.float32)  # one cache each: both write K/V
        built[backend] = build_execution_path(model, kv_cache, BLOCK_SIZE, execution, CPU)
    return built


def test_each_backend_builds_its_own_path_and_both_satisfy_the_protocol(paths):
    assert type(paths["torch"]) is TorchPath and type(paths["triton"]) is TritonPath
    assert all(isinstance(path, ExecutionPath) for path in paths.values())
    config = tiny_config(num_layers=1)
    runner = ModelRunner(random_llama(config, torch.float32, CPU), config, num_blocks=4, block_size=BLOCK_SIZE,
                         dtype=torch.float32, options=WorkerOptions(kernel_backend="triton"))
    assert type(runner.execution_path) is TritonPath


def test_torch_and_triton_paths_agree_through_the_protocol(paths):
    prompts = {"a": [5, 9, 2, 77, 31], "b": [7, 100, 3]}  # a: pages 1-2, b: page 3
    tokens = {rid: list(prompt) for rid, prompt in prompts.items()}
    prefill = StepBatch(1, input_ids=prompts["a"] + prompts["b"], positions=[0, 1, 2, 3, 4, 0, 1, 2],
                        spans=[RequestSpan(0, 5, 5, [1, 2]), RequestSpan(5, 3, 3, [3])], sample_rows=[4, 7])
    for step_id in (1, 2, 3):  # a prefill step, then two decode-only steps (the decode kernel)
        batch = prefill if step_id == 1 else StepBatch(
            step_id, input_ids=[tokens["a"][-1], tokens["b"][-1]],
            positions=[len(tokens["a"]) - 1, len(tokens["b"]) - 1],
            spans=[RequestSpan(0, 1, len(tokens["a"]), [1, 2]), RequestSpan(1, 1, len(tokens["b"]), [3, 4])],
            sample_rows=[0, 1])
        rows = [SamplingRow(GREEDY, tokens[rid], len(prompts[rid])) for rid in ("a", "b")]
        outputs = {}
        with torch.inference_mode():
            for backend, path in paths.items():
                logits = path.forward(batch, path.prepare(batch))  # [2, vocab]
                outputs[backend] = (logits, path.sample(batch, logits, rows))
        torch.testing.assert_close(outputs["triton"][0], outputs["torch"][0], atol=1e-4, rtol=1e-4)
        sampled, logprobs = outputs["torch"][1]
        assert outputs["triton"][1] == (sampled, [None, None]) and logprobs == [None, None]
        for rid, token in zip(("a", "b"), sampled):
            tokens[rid].append(token)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prepare_refuses_a_block_table_too_short_for_its_context(paths, backend):
    batch = StepBatch(9, input_ids=[1] * 5, positions=list(range(5)), spans=[RequestSpan(0, 5, 5, [1])], sample_rows=[4])
    with pytest.raises(ValueError, match="cannot hold context_len=5"):
        paths[backend].prepare(batch)
