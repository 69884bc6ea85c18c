"""A request preempted by swap resumes with the same greedy output as an undisturbed one: the real
runner copies its K/V pages to the host tier and back into other device pages (tokenmill.llm over a
tiny random-weight model, so the pages hold real K/V and any misplaced copy changes the tokens)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from core.sampling import SamplingParams
from tests.helpers.tiny_models import make_tiny_hf_model
from scheduler.options import SchedulerOptions
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig

PROMPTS = [[(7 * i + j) % 200 + 3 for j in range(6 + 5 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("swap"), "llama_gqa")[0]


def generate(folder, async_scheduling: bool = False, **worker):
    llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, model=str(folder), block_size=4, **worker),
                           scheduler=SchedulerOptions(max_num_batched_tokens=64, async_scheduling=async_scheduling)),
              progress=False)
    return llm, llm.generate_token_ids(PROMPTS, GREEDY)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_swapped_requests_keep_their_greedy_output(folder, async_scheduling):
    _, expected = generate(folder, num_blocks=256)
    llm, got = generate(folder, num_blocks=16, swap_space_gb=2**20 / 2**30, async_scheduling=async_scheduling)
    scheduler = llm.engine.scheduler
    assert scheduler.num_swapped_preemptions > 0  # the cache holds 64 tokens; the prompts and outputs need ~300
    assert scheduler.num_swapped_preemptions == scheduler.num_preemptions
    assert got == expected
