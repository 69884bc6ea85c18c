"""Prompt logprobs (SamplingParams.prompt_logprobs) through the in-process engine equal a direct float32
forward's log_softmax at the prompt positions: in one chunk, across prefill chunks, beside a request that
does not ask, after the same prompt filled the prefix cache, under async scheduling, and after a preemption
mid-prompt (by recompute or swap)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from core.sampling import SamplingParams
from scheduler.request import Request
from tests.helpers.tiny_models import make_tiny_hf_model
from scheduler.options import SchedulerOptions
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig

TOP = 3
TOLERANCE = 2e-4  # float32 paged engine vs transformers eager, both float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, model = make_tiny_hf_model(tmp_path_factory.mktemp("prompt-logprobs"), "qwen2")
    # a token budget of 16 splits the 37- and 50-token prompts into chunks
    config = EngineConfig(worker=replace(ENGINE_WORKER, model=str(folder), num_blocks=64),
                          scheduler=SchedulerOptions(max_num_batched_tokens=16))
    return LLM(config, progress=False), model, config


def reference(model, prompt: list[int]) -> torch.Tensor:
    """[P, V]: log_softmax of a direct float32 forward, row i predicting token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_prompt_logprobs(entries, model, prompt: list[int], top: int = TOP) -> None:
    expected = reference(model, prompt)
    assert len(entries) == len(prompt) - 1
    for position, entry in enumerate(entries, start=1):
        row = expected[position - 1]
        assert entry.logprob == pytest.approx(row[prompt[position]].item(), abs=TOLERANCE), position
        want_values, want_ids = row.topk(top)
        assert [token_id for token_id, _ in entry.top] == want_ids.tolist(), position
        assert [value for _, value in entry.top] == pytest.approx(want_values.tolist(), abs=TOLERANCE)


def prompt_of(length: int, salt: int) -> list[int]:
    return [(7 * j + salt) % 120 + 3 for j in range(length)]


def first_output(outputs):
    return next(output for output in outputs if output.new_token_ids)


def test_prompt_logprobs_equal_direct_forward_chunked_and_mixed(tiny):
    llm, model, _ = tiny
    short, long = prompt_of(9, 1), prompt_of(50, 2)  # 50 tokens: four prefill chunks of at most 16
    asks = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP, logprobs=1)
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([short, long, prompt_of(30, 3)], [asks, asks, plain])
    check_prompt_logprobs(first_output(outputs[0]).prompt_logprobs, model, short)
    check_prompt_logprobs(first_output(outputs[1]).prompt_logprobs, model, long)
    # only the first output carries them; the request that did not ask gets none
    assert all(output.prompt_logprobs is None for output in outputs[1][1:])
    assert all(output.prompt_logprobs is None for output in outputs[2])
    # the sampled tokens are what they are without prompt logprobs
    assert llm.generate_token_ids([long], [replace(asks, prompt_logprobs=None)])[0] == \
        [t for output in outputs[1] for t in output.new_token_ids]


def test_prompt_logprobs_of_a_one_token_prompt_are_empty(tiny):
    llm, _, _ = tiny
    outputs = llm.generate([[5]], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0))[0]
    assert first_output(outputs).prompt_logprobs == []


def test_prompt_logprobs_skip_the_prefix_cache(tiny):
    llm, model, _ = tiny
    prompt = prompt_of(37, 4)  # two full 16-token pages, cached by the first request
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm.generate([prompt], plain)
    warm = llm.generate([prompt], plain)[0]
    assert warm[-1].num_cached_tokens == 32  # the pages are there to hit

    asks = replace(plain, prompt_logprobs=TOP)
    outputs = llm.generate([prompt], asks)[0]
    assert outputs[-1].num_cached_tokens == 0  # computed from position 0: every prompt row reaches lm_head
    check_prompt_logprobs(first_output(outputs).prompt_logprobs, model, prompt)
    assert [t for output in outputs for t in output.new_token_ids] == [t for output in warm for t in output.new_token_ids]
    assert llm.generate([prompt], plain)[0][-1].num_cached_tokens == 32  # others still hit


def test_prompt_logprobs_under_async_scheduling(tiny):
    llm, model, config = tiny
    asynchronous = LLM(replace(config, scheduler=replace(config.scheduler, async_scheduling=True)), runner=llm.runner,
                       progress=False)
    prompts = [prompt_of(41, 5), prompt_of(12, 6)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    outputs = asynchronous.generate(prompts, params)
    for prompt, request_outputs in zip(prompts, outputs):
        check_prompt_logprobs(first_output(request_outputs).prompt_logprobs, model, prompt, top=1)


@pytest.mark.parametrize("swap, async_scheduling", [(False, False), (True, False), (False, True)])
def test_prompt_logprobs_of_a_request_preempted_mid_prompt(tiny, swap, async_scheduling):
    """Six pages: a 30-token request decoding beside a 60-token one that asks for prompt logprobs takes
    the pages the latter needs for its fourth chunk, so the latter is preempted with 47 of its 60 prompt
    tokens computed. By recompute it starts again from 0 and its chunks repeat positions already
    gathered (one straddles the end of them: 45..60 against 47 held); by swap it resumes at 47. Either
    way its prompt logprobs come out once per position, equal to an undisturbed run's and transformers'."""
    llm, model, config = tiny
    bytes_per_page = 2 * 2 * 16 * 2 * 16 * 4  # K+V x layers x tokens x KV heads x head dim x float32
    tight = LLM(replace(config, worker=replace(config.worker, num_blocks=6,
                                               swap_space_gb=(16 * bytes_per_page if swap else 0) / 2**30),
                        scheduler=replace(config.scheduler, async_scheduling=async_scheduling)), progress=False)
    decoding = Request("decoding", prompt_of(30, 7), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    asks = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    victim = Request("victim", prompt_of(60, 8), asks)
    engine = tight.engine
    outputs, computed_when_preempted = [], []
    engine.add_request(decoding)
    engine.add_request(victim)
    while engine.has_unfinished():
        num_computed, num_preemptions = victim.num_computed_tokens, victim.num_preemptions
        outputs += [output for output in engine.step() if output.request_id == victim.request_id]
        if victim.num_preemptions > num_preemptions:
            computed_when_preempted.append(num_computed)
            # swap keeps its computed pages; recompute starts over
            assert victim.num_computed_tokens == (num_computed if swap else 0)

    assert computed_when_preempted and all(0 < n < victim.num_prompt_tokens for n in computed_when_preempted)
    assert engine.scheduler.num_swapped_preemptions == (len(computed_when_preempted) if swap else 0)
    check_prompt_logprobs(first_output(outputs).prompt_logprobs, model, victim.prompt_token_ids)
    undisturbed = llm.generate([victim.prompt_token_ids], asks)[0]
    assert [t for output in outputs for t in output.new_token_ids] == \
        [t for output in undisturbed for t in output.new_token_ids]
    ours_all, theirs_all = first_output(outputs).prompt_logprobs, first_output(undisturbed).prompt_logprobs
    assert len(ours_all) == len(theirs_all) == victim.num_prompt_tokens - 1
    for ours, theirs in zip(ours_all, theirs_all):
        assert ours.logprob == pytest.approx(theirs.logprob, abs=TOLERANCE)
        assert [token_id for token_id, _ in ours.top] == [token_id for token_id, _ in theirs.top]
