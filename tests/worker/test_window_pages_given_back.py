"""A sliding-window request whose oldest pages the scheduler gave back (scheduler.pages.kv_manager): the first
entries of its block table then name pages that another request may overwrite (the worker's copy of a
running request keeps the old ids), or FREED_BLOCK_ID in a table sent in full (a swapped request
resumed). Neither may change what it computes, on the torch path (which gathers those pages and masks
them) or the Triton path (whose windowed kernels start at the window). The pages given back are
filled with large finite junk, what another request's K/V could be, and every logprob must stay equal
to the run where they were left alone."""
from __future__ import annotations

import pytest
import torch

from core.sampling import SamplingParams
from core.step import FREED_BLOCK_ID, CachedRequestData, NewRequestData, StepPlan
from tests.helpers.tiny_models import SLIDING_WINDOW, make_tiny_hf_model
from worker.options import WorkerOptions
from worker.loader import load_model
from worker.model_runner import ModelRunner

BLOCK_SIZE = 4
PARAMS = SamplingParams(temperature=0.0, logprobs=5, max_tokens=64)
PROMPT = [(7 * i) % 250 for i in range(30)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, _ = make_tiny_hf_model(tmp_path_factory.mktemp("window-pages"), "mistral_window")
    return load_model(folder, progress=False)


def num_dead_pages(num_computed_tokens: int) -> int:
    # the scheduler's rule: the next token, at position num_computed_tokens, attends to positions
    # > num_computed_tokens - window
    return max(0, num_computed_tokens - SLIDING_WINDOW + 1) // BLOCK_SIZE


def logprobs_of(result, request_id):
    entry = result.logprobs[request_id]
    return result.sampled_token_ids[request_id], entry.logprob, entry.top


def run(runner: ModelRunner, junk: bool) -> list:
    """Chunked prefill (20 + 10 tokens), decodes, and the same request resumed in full with its given-back
    pages as FREED_BLOCK_ID; with junk, every page given back is overwritten before the step after."""
    table = [5, 9, 2, 14, 7, 11, 3, 12, 6, 10]  # 40 tokens
    storage = runner.kv_cache.storage  # [2, L, num_blocks, block_size, KVH, D]
    generator = torch.Generator().manual_seed(0)

    def give_back(num_computed: int) -> None:
        if junk:
            for block_id in table[:num_dead_pages(num_computed)]:
                storage[:, :, block_id] = torch.randn(storage[:, :, block_id].shape, generator=generator) * 50

    results = [runner.execute(StepPlan(1, [NewRequestData("a", PROMPT, len(PROMPT), PARAMS, table, 0)],
                                       num_scheduled_tokens={"a": 20}))]
    give_back(20)  # 3 pages; the second chunk's prefix read (context_blocks / prefill kernel) skips them
    results.append(runner.execute(StepPlan(2, cached_requests=[CachedRequestData("a", [], 20)],
                                           num_scheduled_tokens={"a": 10})))
    for step in range(3, 8):
        num_computed = runner.requests["a"].num_computed_tokens
        give_back(num_computed)
        results.append(runner.execute(StepPlan(step, cached_requests=[CachedRequestData("a", [], num_computed)],
                                               num_scheduled_tokens={"a": 1})))
    # resumed in full (as after a swap): the pages it gave back arrive as FREED_BLOCK_ID
    state = runner.requests["a"]
    num_computed, tokens = state.num_computed_tokens, list(state.token_ids)
    num_dead = num_dead_pages(num_computed)
    resumed = [FREED_BLOCK_ID] * num_dead + table[num_dead:]
    give_back(num_computed)
    results.append(runner.execute(StepPlan(8, [NewRequestData("b", tokens, len(PROMPT), PARAMS, resumed, num_computed)],
                                           num_scheduled_tokens={"b": 1}, finished_request_ids=["a"])))
    assert not results[0].sampled_token_ids  # a mid-prompt chunk
    return [logprobs_of(result, rid) for result, rid in zip(results[1:], ["a"] * 6 + ["b"])]


@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])  # triton: interpreted on CPU
def test_pages_given_back_are_never_read(tiny, kernel_backend):
    model, config = tiny
    assert config.every_layer_window == SLIDING_WINDOW
    outputs = {}
    for junk in (False, True):
        runner = ModelRunner(model, config, num_blocks=16, block_size=BLOCK_SIZE, dtype=torch.float32,
                             options=WorkerOptions(kernel_backend=kernel_backend))
        outputs[junk] = run(runner, junk)
    assert len(outputs[True]) == 7
    for (token, logprob, top), (junk_token, junk_logprob, junk_top) in zip(outputs[False], outputs[True]):
        assert junk_token == token
        assert junk_logprob == pytest.approx(logprob, abs=1e-6)
        assert [t for t, _ in junk_top] == [t for t, _ in top]
        assert [lp for _, lp in junk_top] == pytest.approx([lp for _, lp in top], abs=1e-6)
