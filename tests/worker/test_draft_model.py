"""--speculative draft in the in-process engine (tokenmill.llm.LLM) on tiny random models (issue 35): the worker
runs a draft model beside the target, its KV cache over the target's page ids, and the scheduler verifies its
guesses. Greedy output is token for token the plain engine's, with a random draft (most guesses rejected), with
the target as its own draft (every guess accepted), under penalties, logprobs, a stop token, a prefix-cache hit
and preemption with swap; and a draft of another vocabulary, or --speculative draft without a draft model, is
refused at start."""
from __future__ import annotations

from dataclasses import replace

import pytest

from core.sampling import SamplingParams
from core.step import StepPlan
from scheduler.options import SchedulerOptions
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig
from worker.build import build_runner
from worker.model_runner import PlanMismatchError

PROMPTS = [[5, 77, 200, 13, 9, 41, 250, 3, 18], [7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [100, 3],
           [5, 77, 200, 13, 9, 41, 250, 3, 18, 60, 61]]  # the last shares the first's two full pages
GREEDY = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)
PARAMS = [GREEDY, replace(GREEDY, repetition_penalty=1.3, presence_penalty=0.5), replace(GREEDY, logprobs=2),
          replace(GREEDY, max_tokens=40)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target folder, a smaller random draft of the same tokenizer)."""
    target, _ = make_tiny_hf_model(tmp_path_factory.mktemp("target"), "llama_gqa")
    draft, _ = make_tiny_hf_model(tmp_path_factory.mktemp("draft"), "llama", seed=7, num_hidden_layers=1)
    return target, draft


def engine(target, draft=None, k=4, **worker):
    scheduler = SchedulerOptions(max_num_batched_tokens=64, **({"speculative": "draft", "num_speculative_tokens": k}
                                                               if draft else {}))
    options = replace(ENGINE_WORKER, model=str(target), block_size=4, draft_model=draft and str(draft),
                      **{"num_blocks": 96, **worker})
    return LLM(EngineConfig(worker=options, scheduler=scheduler), progress=False)


def outputs(llm, prompts=PROMPTS, params=PARAMS):
    return [[(token, entry.logprob if entry else None) for out in outs
             for token, entry in zip(out.new_token_ids, out.logprobs or [None] * len(out.new_token_ids))]
            for outs in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def expected(models):
    return outputs(engine(models[0]))


def same(got, want):
    """The same tokens, and logprobs within float32 noise (a verify row vs a decode row)."""
    assert [[token for token, _ in tokens] for tokens in got] == [[token for token, _ in tokens] for tokens in want]
    for got_tokens, want_tokens in zip(got, want):
        for (_, got_logprob), (_, want_logprob) in zip(got_tokens, want_tokens):
            assert (got_logprob is None) == (want_logprob is None)
            assert got_logprob is None or abs(got_logprob - want_logprob) < 1e-4


def test_the_target_as_its_own_draft_is_always_right_and_changes_nothing(models, expected):
    same(outputs(engine(models[0], draft=models[0])), expected)
    llm = engine(models[0], draft=models[0])  # without penalties (its draft guesses from unpenalised logits)
    same(outputs(llm, PROMPTS[::2], PARAMS[::2]), expected[::2])
    stats = llm.engine.scheduler.speculation.stats()
    assert stats["spec_num_draft_tokens"] > 30
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]  # ~100%: exactly, in float32
    assert stats["spec_accepted_per_position"][3] > 0  # k = 4 reached


def test_a_random_draft_is_mostly_wrong_and_changes_nothing(models, expected):
    llm = engine(models[0], draft=models[1], k=6)
    same(outputs(llm), expected)
    stats = llm.engine.scheduler.speculation.stats()
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"]
    assert llm.runner.drafter.model_config.num_layers == 1


def test_a_stop_token_among_accepted_guesses_ends_the_request_there(models):
    plain = engine(models[0]).generate_token_ids([PROMPTS[0]], GREEDY)[0]
    stop = plain[10]  # a token the greedy text reaches: nothing after its first occurrence
    params = replace(GREEDY, stop_token_ids=[stop])
    got = engine(models[0], draft=models[0]).generate_token_ids([PROMPTS[0]], params)[0]
    assert got == plain[:plain.index(stop) + 1]


def test_preemption_and_swap_keep_the_output(models):
    """18 pages of 4 tokens for 4 requests of ~40 tokens: preemptions, some swapped out and back in (the draft's
    pages travel with the target's), and the output is still the plain engine's."""
    prompts, params = PROMPTS[:3] * 2, replace(GREEDY, max_tokens=32)
    want = engine(models[0], num_blocks=96).generate_token_ids(prompts, params)
    llm = engine(models[0], draft=models[0], num_blocks=18, swap_space_gb=0.001)
    assert llm.runner.drafter.swap_space.num_host_blocks == llm.runner.swap_space.num_host_blocks > 0
    assert llm.generate_token_ids(prompts, params) == want
    assert llm.engine.scheduler.num_swapped_preemptions > 0


def test_the_cache_counts_both_models_bytes_per_page(models):
    """A fixed budget holds fewer pages with a draft: each page id is a page in both caches."""
    alone = build_runner(replace(ENGINE_WORKER, model=str(models[0]), kv_cache_mb=1, block_size=4), progress=False)
    paired = build_runner(replace(ENGINE_WORKER, model=str(models[0]), kv_cache_mb=1, block_size=4,
                                  draft_model=str(models[1])), progress=False)
    target_page = alone.kv_cache.storage[:, :, 0].nbytes
    draft_page = paired.drafter.kv_cache.storage[:, :, 0].nbytes
    assert alone.num_blocks == 2**20 // target_page
    assert paired.num_blocks == paired.drafter.kv_cache.num_blocks == 2**20 // (target_page + draft_page)


@pytest.mark.parametrize("override, field", [({"vocab_size": 300}, "vocab_size"), ({"eos_token_id": 3}, "eos_token_id"),
                                             ({"bos_token_id": 1}, "bos_token_id")])
def test_a_draft_of_another_vocabulary_is_refused_at_start(models, tmp_path, override, field):
    other, _ = make_tiny_hf_model(tmp_path, "llama", num_hidden_layers=1, **override)
    with pytest.raises(ValueError, match=f"--draft-model {other}: its {field} is {next(iter(override.values()))}, "
                                         f"the target's is .*a draft model must have the target's tokenizer"):
        build_runner(replace(ENGINE_WORKER, model=str(models[0]), num_blocks=8, draft_model=str(other)),
                     progress=False)


def test_speculative_draft_without_a_draft_model_is_refused(models):
    with pytest.raises(ValueError, match="--speculative draft needs a draft model"):
        LLM(EngineConfig(worker=replace(ENGINE_WORKER, model=str(models[0]), num_blocks=8),
                         scheduler=SchedulerOptions(speculative="draft")), progress=False)
    with pytest.raises(ValueError, match="is only used with --speculative draft"):
        LLM(EngineConfig(worker=replace(ENGINE_WORKER, model=str(models[0]), num_blocks=8, draft_model=str(models[1])),
                         scheduler=SchedulerOptions(speculative="ngram")), progress=False)


def test_a_plan_asking_for_guesses_of_a_worker_without_a_draft_is_a_mismatch(models):
    runner = build_runner(replace(ENGINE_WORKER, model=str(models[0]), num_blocks=8), progress=False)
    with pytest.raises(PlanMismatchError, match="asks for draft tokens .* no draft model"):
        runner.prepare(StepPlan(step_id=0, num_draft_tokens={"r": 2}))



@pytest.mark.parametrize("path", ["reference", "deterministic", "triton"])
def test_every_execution_path_drafts_and_keeps_the_output(models, path):
    """The draft runs on the target's execution path kind (the Triton one interpreted here; CUDA graphs stay off
    for its steps): the plain torch reference, the batch-invariant kernels and the Triton kernels."""
    worker = {"reference": {"cpu_fused_ops": False, "packed_linears": False}, "deterministic": {"deterministic": True},
              "triton": {"kernel_backend": "triton"}}[path]
    params = replace(GREEDY, max_tokens=10 if path == "triton" else 24)  # the interpreter is slow
    want = engine(models[0], **worker).generate_token_ids(PROMPTS[:2], params)
    llm = engine(models[0], draft=models[0], **worker)
    assert llm.generate_token_ids(PROMPTS[:2], params) == want
    stats = llm.engine.scheduler.speculation.stats()
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0


def test_sampled_output_keeps_its_distribution(models):
    """temperature > 0: the greedy draft's guesses are point masses, so the point-mass rejection sampler keeps
    the target's distribution. The third token's (the first whose step verifies a guess) frequencies over 1,200
    requests at temperature 0.3 match the plain engine's within sampling noise (total variation 0.12 with these
    seeds), and about half the guesses are accepted; a sampler that accepted every guess (the argmax) would move
    the ~45% of the mass outside it."""
    import torch

    params = SamplingParams(max_tokens=4, temperature=0.3, ignore_eos=True)  # token 3 verifies one guess
    prompts = [PROMPTS[1]] * 1200

    def third_tokens(llm) -> dict[int, float]:
        torch.manual_seed(0)
        counts: dict[int, float] = {}
        for tokens in llm.generate_token_ids(prompts, params):
            counts[tokens[2]] = counts.get(tokens[2], 0) + 1 / len(prompts)
        return counts

    plain = third_tokens(engine(models[0]))
    llm = engine(models[0], draft=models[0])
    drafted = third_tokens(llm)
    distance = sum(abs(plain.get(t, 0) - drafted.get(t, 0)) for t in {*plain, *drafted}) / 2
    stats = llm.engine.scheduler.speculation.stats()
    assert stats["spec_num_draft_tokens"] > 800 and 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    assert distance < 0.2, distance
    assert max(plain.values()) < 0.7  # no one token dominates: always accepting the argmax guess would show


def test_a_draft_beside_quantized_target_pages_changes_nothing(models):
    """--kv-cache-dtype int8 quantizes the target's pages only (the draft's stay in the model dtype): the target
    drafting for itself gives the int8 target's own greedy tokens, and a fixed budget counts both page sizes."""
    want = outputs(engine(models[0], kv_cache_dtype="int8"), PROMPTS[::2], PARAMS[::2])
    llm = engine(models[0], draft=models[0], kv_cache_dtype="int8")
    assert [[t for t, _ in tokens] for tokens in outputs(llm, PROMPTS[::2], PARAMS[::2])] == \
        [[t for t, _ in tokens] for tokens in want]
    assert llm.runner.kv_cache.scales is not None and llm.runner.drafter.kv_cache.scales is None
    paired = build_runner(replace(ENGINE_WORKER, model=str(models[0]), kv_cache_mb=1, block_size=4,
                                  kv_cache_dtype="int8", draft_model=str(models[1])), progress=False)
    pages = paired.kv_cache.bytes_per_block + paired.drafter.kv_cache.bytes_per_block
    assert paired.num_blocks == 2**20 // pages
