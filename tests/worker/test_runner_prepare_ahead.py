"""ModelRunner.prepare(step N+1) before run(step N), as the worker does under async scheduling: the
decode rows that need step N's tokens are packed as placeholders and filled in by run(), and every
sampling option (penalties, seeds, logprobs) gives what running the steps one after the other gives."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from core.step import PLACEHOLDER_TOKEN_ID, CachedRequestData, NewRequestData, StepPlan
from core.sampling import SamplingParams
from tests.helpers.tiny_models import make_tiny_hf_model
from worker.options import WorkerOptions
from worker.loader import load_model
from worker.model_runner import ModelRunner, PlanMismatchError
from worker.paths.triton.forward import to_device

BLOCK_SIZE = 4
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=32),
    "penalised": SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.7, max_tokens=32),
    "seeded": SamplingParams(temperature=0.9, top_k=20, seed=1234, max_tokens=32, logprobs=2),
}
PROMPTS = {"greedy": [5, 9, 2, 77, 31], "penalised": [8, 8, 8, 4, 120, 3, 3, 8, 1], "seeded": [60, 61]}


@pytest.fixture(scope="module")
def model_and_config(tmp_path_factory):
    folder, _ = make_tiny_hf_model(tmp_path_factory.mktemp("ahead"), "llama_gqa")
    return load_model(folder, progress=False)


def fresh_runner(model_and_config, kernel_backend: str = "torch") -> ModelRunner:
    model, config = model_and_config
    return ModelRunner(model, config, num_blocks=64, block_size=BLOCK_SIZE, dtype=torch.float32,
                       options=WorkerOptions(kernel_backend=kernel_backend))


def plans(num_decode_steps: int, params: dict[str, SamplingParams] = PARAMS) -> list[StepPlan]:
    """A prefill step, then decode steps, with the block tables an async scheduler would send."""
    blocks = {rid: list(range(16 * i, 16 * i + 16)) for i, rid in enumerate(params)}
    new = [NewRequestData(rid, PROMPTS[rid], len(PROMPTS[rid]), params[rid], blocks[rid], 0) for rid in params]
    steps = [StepPlan(0, new_requests=new, num_scheduled_tokens={rid: len(PROMPTS[rid]) for rid in params})]
    for step in range(1, num_decode_steps + 1):
        cached = [CachedRequestData(rid, [], len(PROMPTS[rid]) + step - 1) for rid in params]
        steps.append(StepPlan(step, cached_requests=cached, num_scheduled_tokens={rid: 1 for rid in params}))
    return steps


# triton: the kernel path (host metadata prepared ahead), in the Triton interpreter on CPU
@pytest.mark.parametrize("kernel_backend, num_decode_steps", [("torch", 6), ("triton", 3)])
def test_prepared_ahead_equals_one_after_the_other(model_and_config, kernel_backend, num_decode_steps):
    steps = plans(num_decode_steps)
    one_by_one = fresh_runner(model_and_config, kernel_backend)
    expected = [one_by_one.execute(plan) for plan in steps]

    runner = fresh_runner(model_and_config, kernel_backend)
    results = []
    prepared = runner.prepare(steps[0])
    for plan in steps[1:]:
        following = runner.prepare(plan)  # before the step it depends on has run
        rows = following.batch.placeholder_rows
        assert len(rows) == len(PARAMS) and all(following.batch.input_ids[row] == PLACEHOLDER_TOKEN_ID
                                                for row in rows)
        results.append(runner.run(prepared))
        prepared = following
    results.append(runner.run(prepared))

    assert [r.sampled_token_ids for r in results] == [r.sampled_token_ids for r in expected]
    for ours, theirs in zip(results, expected):
        assert ours.logprobs["seeded"].top == theirs.logprobs["seeded"].top
    assert all(state.num_pending_tokens == 0 for state in runner.requests.values())


def test_running_a_step_before_the_one_it_depends_on_is_refused(model_and_config):
    steps = plans(1)
    runner = fresh_runner(model_and_config)
    first = runner.prepare(steps[0])
    second = runner.prepare(steps[1])
    with pytest.raises(PlanMismatchError, match="never sampled"):
        runner.run(second)
    runner.run(first)


class HostStager:
    """worker.paths.triton.staging.StepStager's contract on CPU tensors, without streams. The inputs are copied
    when the step is prepared, placeholders (-1) and all, so a placeholder row gets its token only
    through the fill the Triton path does in forward() (an embedding of -1 would raise)."""

    def stage(self, input_ids, positions, host, placeholder_rows=(), placeholder_sources=()):
        def as_long(values):
            return torch.tensor(list(values), dtype=torch.int64)

        return SimpleNamespace(views=(as_long(input_ids), as_long(positions), to_device(host, "cpu"),
                                      as_long(placeholder_rows), as_long(placeholder_sources)),
                               num_placeholders=len(placeholder_rows))

    def take(self, staged):
        return staged.views

    def mark_consumed(self, staged):
        pass


DEVICE_SAMPLED = {"greedy": PARAMS["greedy"],  # argmax on the device
                  "seeded": SamplingParams(temperature=0.9, top_k=20, seed=1234, max_tokens=32)}  # the kernel


@pytest.mark.parametrize("params, num_device_fills", [(DEVICE_SAMPLED, 2), (PARAMS, 0)],
                         ids=["sampled-on-the-device", "penalties-and-logprobs-on-the-host"])
def test_staged_placeholder_rows_read_the_step_befores_tokens(model_and_config, params, num_device_fills):
    """The Triton path with staged inputs (CUDA's stream overlap, here on CPU): each decode step prepared
    before its predecessor ran takes that step's sampled ids on the device when they stayed there, and the
    host-filled ids when that step sampled on the host; either way the tokens of running one by one."""
    steps = plans(2, params)
    one_by_one = fresh_runner(model_and_config, "triton")
    expected = [one_by_one.execute(plan).sampled_token_ids for plan in steps]
    runner = fresh_runner(model_and_config, "triton")
    runner.execution_path.stager = HostStager()
    results, prepared = [], runner.prepare(steps[0])
    for plan in steps[1:]:
        following = runner.prepare(plan)
        assert following.inputs.staged.num_placeholders == len(params)
        results.append(runner.run(prepared).sampled_token_ids)
        prepared = following
    results.append(runner.run(prepared).sampled_token_ids)
    assert results == expected
    assert runner.execution_path.num_device_fills == num_device_fills
