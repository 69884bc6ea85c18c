"""CUDA only: under async scheduling the worker prepares step N+1 on its RPC thread while step N runs on
the compute thread (with stream overlap, prepare() also stages N+1's inputs and starts their H2D copy;
run() writes the placeholder rows from N's sampled ids on the device). The same here with two threads
gives the tokens of running the steps one after the other, and N+1's copy finishes while N still
computes. Skipped without CUDA; tests/gpu/run.sh runs it on the device machine."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from core.step import CachedRequestData, NewRequestData, StepPlan
from core.sampling import SamplingParams
from tests.gpu.random_model import random_llama, tiny_config
from worker.options import WorkerOptions
from worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only paths; run by tests/gpu/run.sh")
BLOCK_SIZE = 4
PARAMS = {"greedy": SamplingParams(temperature=0.0, max_tokens=64),  # argmax on the device
          "sampled": SamplingParams(temperature=0.8, top_k=30, seed=7, max_tokens=64)}  # the sampling kernel


def plans(params: SamplingParams, num_decode_steps: int) -> list[StepPlan]:
    prompts = {"a": list(range(3, 14)), "b": [40, 41, 42], "c": [7, 100, 9, 200, 11]}
    new = [NewRequestData(rid, prompt, len(prompt), params, list(range(12 * i + 1, 12 * i + 13)), 0)
           for i, (rid, prompt) in enumerate(prompts.items())]
    steps = [StepPlan(0, new_requests=new, num_scheduled_tokens={rid: len(p) for rid, p in prompts.items()})]
    for step in range(1, num_decode_steps + 1):
        cached = [CachedRequestData(rid, [], len(p) + step - 1) for rid, p in prompts.items()]
        steps.append(StepPlan(step, cached_requests=cached, num_scheduled_tokens={rid: 1 for rid in prompts}))
    return steps


@pytest.mark.parametrize("params", list(PARAMS.values()), ids=list(PARAMS))
@pytest.mark.parametrize("cuda_graphs, stream_overlap", [(True, True), (False, True), (False, False)])
def test_prepared_on_another_thread_equals_one_after_the_other(params, cuda_graphs, stream_overlap):
    config = tiny_config(num_layers=2)
    model = random_llama(config, torch.float32, torch.device("cuda"), seed=3, std=0.2)

    def runner() -> ModelRunner:
        built = ModelRunner(model, config, num_blocks=40, block_size=BLOCK_SIZE, dtype=torch.float32,
                            options=WorkerOptions(cuda_graphs=cuda_graphs, stream_overlap=stream_overlap,
                                                     graph_batch_sizes=(1, 2, 4)))
        built.warm_up()
        return built

    steps = plans(params, 6)
    sequential = runner()
    expected = [sequential.execute(plan).sampled_token_ids for plan in steps]
    ahead, results, num_with_placeholders = runner(), [], 0
    with ThreadPoolExecutor(max_workers=1) as compute:
        running = compute.submit(ahead.run, ahead.prepare(steps[0]))
        for plan in steps[1:]:
            prepared = ahead.prepare(plan)  # while the previous step may still run
            num_with_placeholders += bool(prepared.batch.placeholder_rows)  # it had not sampled yet
            results.append(running.result().sampled_token_ids)
            running = compute.submit(ahead.run, prepared)
        results.append(running.result().sampled_token_ids)
    assert results == expected
    if stream_overlap:  # each step prepared before its predecessor sampled took those ids on the device
        assert ahead.execution_path.num_device_fills == num_with_placeholders


def test_next_steps_copy_finishes_while_the_step_before_computes():
    config = tiny_config(num_layers=2)
    model = random_llama(config, torch.float32, torch.device("cuda"), seed=3, std=0.2)
    options = WorkerOptions(cuda_graphs=True, stream_overlap=True, graph_batch_sizes=(1, 2, 4))
    steps = plans(PARAMS["greedy"], 2)
    sequential = ModelRunner(model, config, num_blocks=40, block_size=BLOCK_SIZE, dtype=torch.float32, options=options)
    sequential.warm_up()
    expected = [sequential.execute(plan).sampled_token_ids for plan in steps]

    runner = ModelRunner(model, config, num_blocks=40, block_size=BLOCK_SIZE, dtype=torch.float32, options=options)
    runner.warm_up()
    results = [runner.execute(steps[0]).sampled_token_ids]
    step_1 = runner.prepare(steps[1])
    torch.cuda._sleep(6_000_000_000)  # step 1's kernels queue behind ~3 s of spinning on the compute stream
    spun = torch.cuda.Event()
    spun.record()
    with ThreadPoolExecutor(max_workers=1) as compute:
        running = compute.submit(runner.run, step_1)
        step_2 = runner.prepare(steps[2])  # stages its inputs on the copy stream
        deadline = time.monotonic() + 60
        while not step_2.inputs.staged.slot.copied.query():
            assert time.monotonic() < deadline, "step 2's H2D copy never finished"
            time.sleep(0.001)
        assert not spun.query(), "step 2's copy waited for step 1's compute"
        results.append(running.result().sampled_token_ids)
    results.append(runner.run(step_2).sampled_token_ids)
    assert results == expected
    assert runner.execution_path.num_device_fills == 1  # step 2's decode rows took step 1's ids on the device
