"""The in-process engine on the tiny Mistral with a 7-token window on every layer: the scheduler gives
back each request's pages that lie before its window, and the worker keeps attending correctly while
the first entries of its block tables name pages given back and reused by other requests. Reference:
transformers `generate` on the same weights (greedy tokens, and the chosen tokens' logprobs, which
any read of a reused page outside the mask would change), and the same engine keeping every page."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from core.sampling import SamplingParams
from scheduler.request import Request
from tests.helpers.tiny_models import EOS_ID, SLIDING_WINDOW, make_tiny_hf_model
from scheduler.options import SchedulerOptions
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig

BLOCK_SIZE = 4
LOGPROB_ATOL = 1e-4  # float32, torch path vs transformers
_ids = itertools.count()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("sliding"), "mistral_window")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)


def run_counting_pages(engine, prompts, max_tokens) -> tuple[list[list[int]], list[list[float]], int]:
    """(tokens per prompt, their logprobs, most device pages held after any step)."""
    requests = [Request(f"sw-{next(_ids)}", list(prompt), greedy(max_tokens), eos_token_id=EOS_ID) for prompt in prompts]
    logprobs = {request.request_id: [] for request in requests}
    for request in requests:
        engine.add_request(request)
    most_pages = 0
    while engine.has_unfinished():
        for output in engine.step():
            logprobs[output.request_id].extend(entry.logprob for entry in output.logprobs)
        most_pages = max(most_pages, engine.scheduler.kv.pool.num_used)
    return [r.output_token_ids for r in requests], [logprobs[r.request_id] for r in requests], most_pages


def transformers_greedy(hf_model, prompt, max_tokens) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(scores[0].float(), -1)[token].item() for scores, token in zip(out.scores, tokens)]
    return tokens, logprobs


@pytest.mark.parametrize("kernel_backend, max_tokens", [("torch", 70), ("triton", 30)])  # triton: interpreted on CPU
def test_a_long_generation_holds_its_window_with_transformers_tokens(tiny, kernel_backend, max_tokens):
    folder, hf_model = tiny
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    config = EngineConfig(worker=replace(ENGINE_WORKER, model=str(folder), block_size=BLOCK_SIZE, num_blocks=64,
                                          kernel_backend=kernel_backend))
    llm = LLM(config, progress=False)
    assert llm.model_config.every_layer_window == SLIDING_WINDOW
    (tokens,), (logprobs,), most_pages = run_counting_pages(llm.engine, [prompt], max_tokens)
    keeping = replace(config, scheduler=replace(config.scheduler, free_window_pages=False))
    (kept_tokens,), _, kept_pages = run_counting_pages(llm.new_engine(keeping), [prompt], max_tokens)
    expected_tokens, expected_logprobs = transformers_greedy(hf_model, prompt, max_tokens)
    assert tokens == kept_tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=LOGPROB_ATOL)
    # the prompt's 10 tokens take 3 pages at first; from then on the window (7 tokens) spans at most
    # 2 full pages plus the one being filled, where keeping every page grows to (10 + 70) / 4 = 20
    assert most_pages == -(-SLIDING_WINDOW // BLOCK_SIZE) + 1
    assert kept_pages == -(-(len(prompt) + max_tokens) // BLOCK_SIZE)


@pytest.mark.parametrize("async_scheduling, swap", [(False, False), (True, False), (False, True)])
def test_requests_sharing_a_tight_pool_keep_transformers_tokens(tiny, async_scheduling, swap):
    """Eight requests in 16 pages, prefilled in chunks of up to 16 tokens: pages given back are reused
    by the others at once (the worker's tables still name them, masked), prefix hits land on pages
    that windows gave back, and preemption (recompute, or swap to the host tier) brings requests back
    past their windows."""
    folder, hf_model = tiny
    prompts = [[40 + i // 2] * 9 + list(range(60 + 5 * i, 63 + 5 * i + 2 * i % 11)) for i in range(8)]
    max_tokens = 30
    bytes_per_page = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # K+V x layers x tokens x KV heads x head dim x float32
    worker = replace(ENGINE_WORKER, model=str(folder), block_size=BLOCK_SIZE, num_blocks=16,
                     swap_space_gb=(64 * bytes_per_page if swap else 0) / 2**30)
    llm = LLM(EngineConfig(worker=worker, scheduler=SchedulerOptions(max_num_batched_tokens=16,
                                                                     async_scheduling=async_scheduling)),
              progress=False)
    tokens, logprobs, _ = run_counting_pages(llm.engine, prompts, max_tokens)
    for prompt, ours, our_logprobs in zip(prompts, tokens, logprobs):
        expected_tokens, expected_logprobs = transformers_greedy(hf_model, prompt, max_tokens)
        assert ours == expected_tokens
        assert our_logprobs == pytest.approx(expected_logprobs, abs=LOGPROB_ATOL)
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.kv.prefix_hits > 0
    assert scheduler.num_swapped_preemptions > 0 if swap else scheduler.num_swapped_preemptions == 0


@pytest.mark.parametrize("flavour, window", [("mistral_window", SLIDING_WINDOW), ("gemma2", None), ("gemma3", None),
                                             ("mistral", None)])
def test_only_models_that_slide_on_every_layer_give_pages_back(tmp_path, flavour, window):
    """gemma's global layers still read every page; a mistral without a window has none to slide."""
    folder, _ = make_tiny_hf_model(tmp_path, flavour)
    llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, model=str(folder), block_size=BLOCK_SIZE, num_blocks=64)),
              progress=False)
    assert llm.model_config.every_layer_window == window
    assert llm.engine.scheduler.config.sliding_window == window
