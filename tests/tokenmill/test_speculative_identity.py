"""Issue 35's identity target: greedy outputs identical with and without `--speculative ngram` on 64 prompts, on two
architectures (llama; qwen3, with its q/k norms), through the in-process engine: the real prompt-lookup proposer
in the overlapped loop (the default: requests sit steps out to propose, could_propose spares some) and in the
synchronous one, at one and at 64 requests a batch, with drafts accepted and rejected along the way."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from core.sampling import SamplingParams
from scheduler.options import SchedulerOptions
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig


def prompts_of(count: int, seed: int = 0) -> list[list[int]]:
    """Half repeat a phrase (prompt lookup finds drafts there), half are random bytes (little to find)."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        if i % 2:
            phrase = [rng.randrange(3, 256) for _ in range(rng.randrange(2, 7))]
            prompts.append((phrase * 12)[:rng.randrange(8, 40)])
        else:
            prompts.append([rng.randrange(3, 256) for _ in range(rng.randrange(4, 40))])
    return prompts


@pytest.mark.parametrize("flavour", ["llama", "qwen3"])
def test_greedy_outputs_are_identical_with_ngram_speculation_on_64_prompts(tmp_path, flavour):
    folder, _ = make_tiny_hf_model(tmp_path, flavour)
    worker = replace(ENGINE_WORKER, model=str(folder), num_blocks=512)
    llm = LLM(EngineConfig(worker=worker), progress=False)
    prompts = prompts_of(64)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = llm.generate_token_ids(prompts, params)
    one_at_a_time = {tuple(prompt): output for prompt, output in zip(prompts, expected)}
    for async_scheduling in (True, False):
        llm.engine = llm.new_engine(EngineConfig(worker=worker, scheduler=SchedulerOptions(
            speculative="ngram", num_speculative_tokens=8, async_scheduling=async_scheduling)))
        assert llm.generate_token_ids(prompts, params) == expected, async_scheduling  # 64 at once
        for prompt in prompts[:8]:  # and alone, where the overlapped loop sits a request's steps out
            assert llm.generate_token_ids([prompt], params) == [one_at_a_time[tuple(prompt)]], async_scheduling
        speculation = llm.engine.scheduler.speculation
        assert 0 < speculation.num_accepted_tokens < speculation.num_draft_tokens, async_scheduling
