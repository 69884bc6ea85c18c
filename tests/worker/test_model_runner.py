"""ModelRunner as an Executor: request state kept across steps, greedy generation equal to transformers,
logprobs only where asked, and clear errors when a plan disagrees with the worker's copy."""
from __future__ import annotations

import pytest
import torch

from scheduler.executor import Executor
from core.step import CachedRequestData, NewRequestData, StepPlan
from core.sampling import SamplingParams
from tests.helpers.tiny_models import make_tiny_hf_model
from worker.loader import load_model
from worker.model.kv_cache import num_blocks_for_budget
from worker.model_runner import ModelRunner, PlanMismatchError

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, hf_model = make_tiny_hf_model(tmp_path_factory.mktemp("runner"), "llama_gqa")
    model, config = load_model(folder, progress=False)
    return hf_model, model, config


@pytest.fixture
def runner(tiny):
    _, model, config = tiny
    return ModelRunner(model, config, num_blocks=64, block_size=BLOCK_SIZE, dtype=torch.float32)


def new_request(request_id, prompt, blocks, params=GREEDY, num_computed=0):
    return NewRequestData(request_id, list(prompt), len(prompt), params, list(blocks), num_computed)


def test_is_an_executor(runner):
    executor: Executor = runner
    assert (executor.block_size, executor.num_blocks) == (BLOCK_SIZE, 64)
    assert runner.kv_cache.key_caches[0].shape == (64, BLOCK_SIZE, runner.model_config.num_kv_heads, runner.model_config.head_dim)


def test_kv_budget_counts_whole_blocks(tiny):
    config = tiny[2]
    # K and V, every layer, block_size tokens, KVH * D float32 values each
    per_block = 2 * config.num_layers * BLOCK_SIZE * config.num_kv_heads * config.head_dim * 4
    assert num_blocks_for_budget(config, torch.float32, BLOCK_SIZE, 10 * per_block + per_block - 1) == 10
    assert num_blocks_for_budget(config, torch.bfloat16, BLOCK_SIZE, 10 * per_block) == 20
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_budget(config, torch.float32, BLOCK_SIZE, per_block - 1)


def test_greedy_generation_matches_transformers(tiny, runner):
    hf_model = tiny[0]
    prompt = [5, 77, 200, 13, 9, 41, 250, 3, 18]
    blocks = [10, 3, 7]  # 12 slots: the prompt plus 3 tokens; the rest arrive as diffs
    result = runner.execute(StepPlan(1, [new_request("r", prompt, blocks)], num_scheduled_tokens={"r": len(prompt)}))
    generated = [result.sampled_token_ids["r"]]
    spare = iter([30, 31, 22, 40])
    for step in range(2, 12):
        num_computed = len(prompt) + len(generated) - 1
        new_blocks = [next(spare)] if num_computed % BLOCK_SIZE == 0 else []
        plan = StepPlan(step, cached_requests=[CachedRequestData("r", new_blocks, num_computed)], num_scheduled_tokens={"r": 1})
        result = runner.execute(plan)
        assert result.step_id == step and result.forward_ns > 0
        generated.append(result.sampled_token_ids["r"])
    expected = list(prompt)
    with torch.no_grad():
        for _ in range(len(generated)):
            expected.append(int(hf_model(torch.tensor([expected])).logits[0, -1].argmax()))
    assert generated == expected[len(prompt) :]
    assert runner.requests["r"].token_ids == expected  # the runner's own copy grew with each sample


def test_chunked_prefill_samples_only_at_the_end(runner):
    prompt = list(range(1, 12))
    first = runner.execute(StepPlan(1, [new_request("r", prompt, [0, 1, 2])], num_scheduled_tokens={"r": 6}))
    assert first.sampled_token_ids == {} and runner.requests["r"].num_computed_tokens == 6
    second = runner.execute(StepPlan(2, cached_requests=[CachedRequestData("r", [], 6)], num_scheduled_tokens={"r": 5}))
    assert set(second.sampled_token_ids) == {"r"} and len(runner.requests["r"].token_ids) == 12


def test_logprobs_only_for_requests_that_asked(tiny, runner):
    hf_model = tiny[0]
    with_logprobs = SamplingParams(temperature=0.0, logprobs=2)
    prompt = [4, 8, 15, 16, 23, 42]
    plan = StepPlan(1, [new_request("plain", prompt, [0, 1]), new_request("asks", prompt, [2, 3], with_logprobs)])
    plan.num_scheduled_tokens = {"plain": 6, "asks": 6}
    result = runner.execute(plan)
    assert "plain" not in result.logprobs
    assert "asks" in result.logprobs, f"no logprobs for the request that asked for 2: {result.logprobs}"
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1], dim=-1)
    token = result.sampled_token_ids["asks"]
    assert result.logprobs["asks"].logprob == pytest.approx(expected[token].item(), abs=1e-4)


def test_finished_requests_are_dropped_first(runner):
    runner.execute(StepPlan(1, [new_request("r", [1, 2, 3], [0])], num_scheduled_tokens={"r": 3}))
    assert runner.execute(StepPlan(2, finished_request_ids=["r"])).sampled_token_ids == {}
    assert "r" not in runner.requests
    # a resumed request arrives in full again, in the same plan that drops its old copy
    plan = StepPlan(3, [new_request("r", [1, 2, 3, 4], [5, 6])], num_scheduled_tokens={"r": 4}, finished_request_ids=["r"])
    assert set(runner.execute(plan).sampled_token_ids) == {"r"}


def test_unknown_request_id_is_an_error(runner):
    with pytest.raises(PlanMismatchError, match="step 1: unknown request id 'ghost'"):
        runner.execute(StepPlan(1, num_scheduled_tokens={"ghost": 1}))
    with pytest.raises(PlanMismatchError, match="unknown request id 'ghost'"):
        runner.execute(StepPlan(2, cached_requests=[CachedRequestData("ghost", [], 0)]))


def test_num_computed_disagreement_is_an_error(runner):
    runner.execute(StepPlan(1, [new_request("r", [1, 2, 3], [0])], num_scheduled_tokens={"r": 3}))
    plan = StepPlan(2, cached_requests=[CachedRequestData("r", [], 2)], num_scheduled_tokens={"r": 1})
    with pytest.raises(PlanMismatchError, match="'r' has num_computed_tokens=2 in the plan but 3 in the worker"):
        runner.execute(plan)


def test_scheduling_past_the_known_tokens_is_an_error(runner):
    plan = StepPlan(1, [new_request("r", [1, 2, 3], [0])], num_scheduled_tokens={"r": 4})
    with pytest.raises(PlanMismatchError, match="scheduled 4 tokens from 0, but it has 3 tokens"):
        runner.execute(plan)


def test_block_table_too_short_is_an_error(runner):
    plan = StepPlan(1, [new_request("r", list(range(6)), [0])], num_scheduled_tokens={"r": 6})
    with pytest.raises(PlanMismatchError, match="block table of 1 blocks cannot hold context_len=6"):
        runner.execute(plan)


def test_empty_plan_and_warm_up(runner):
    assert runner.execute(StepPlan(7)).step_id == 7
    runner.warm_up()


def test_block_id_outside_the_cache_is_an_error(runner):
    plan = StepPlan(1, [new_request("r", [1, 2, 3], [64])], num_scheduled_tokens={"r": 3})
    with pytest.raises(PlanMismatchError, match="request 'r' got block id 64, outside 0..63"):
        runner.execute(plan)
