"""Speculative decoding through the real scheduler and the real ModelRunner on a tiny random model: a step
verifies each request's drafts as one multi-token row over its pages, and greedy output is token for token
what decoding one token a step gives, on the torch reference path, the CPU path `tokenmill serve` runs by
default (compiled ops), the batch-invariant (deterministic) path and the Triton path (interpreted here;
tests/gpu/run.sh runs it on a GPU)."""
from __future__ import annotations

import random

import pytest
import torch

from core.sampling import SamplingParams
from scheduler.config import SchedulerConfig
from scheduler.engine import EngineCore
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from scheduler.speculation import Speculation
from tests.helpers.tiny_models import make_tiny_hf_model
from worker.loader import load_model
from worker.model_runner import ModelRunner
from worker.native_ops import cpu_ops_available
from worker.options import WorkerOptions

BLOCK_SIZE = 4
PATHS = {
    "reference": WorkerOptions(cpu_fused_ops=False, packed_linears=False),
    "cpu-default": WorkerOptions(),
    "deterministic": WorkerOptions(deterministic=True),
    "triton": WorkerOptions(kernel_backend="triton"),  # interpreted on CPU
}
PROMPTS = [[5, 77, 200, 13, 9, 41, 250, 3, 18], [7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [100, 3]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # one layer: the Triton cases run under the interpreter, whose cost is per layer
    folder, _ = make_tiny_hf_model(tmp_path_factory.mktemp("spec-runner"), "llama_gqa", num_hidden_layers=1)
    return load_model(folder, progress=False)


class OracleProposer:
    """Drafts from the known greedy continuation, each wrong with probability error_rate."""

    on_worker = False  # proposes on the scheduler's side

    def __init__(self, expected: dict[tuple[int, ...], list[int]], error_rate: float, seed: int = 0) -> None:
        self.expected, self.error_rate, self.rng = expected, error_rate, random.Random(seed)

    def propose(self, request, k):
        full = self.expected[tuple(request.prompt_token_ids)]
        drafts = full[request.num_tokens:request.num_tokens + k]
        return [(t + 1) % 256 if self.rng.random() < self.error_rate else t for t in drafts]

    def could_propose(self, request):
        return True


def generate(tiny, options, prompts, speculation=None, max_tokens=24, params=None):
    model, config = tiny
    runner = ModelRunner(model, config, num_blocks=96, block_size=BLOCK_SIZE, dtype=torch.float32, options=options)
    scheduler = Scheduler(SchedulerConfig(num_blocks=96, block_size=BLOCK_SIZE, max_model_len=256,
                                          sliding_window=config.every_layer_window,  # pages behind it go back
                                          **({"speculative": "ngram", "num_speculative_tokens": 6} if speculation else {})))
    if speculation is not None:
        scheduler.speculation = speculation
    engine = EngineCore(scheduler, runner, async_scheduling=speculation is None)
    sampling = params or SamplingParams(temperature=0.0, max_tokens=max_tokens)
    requests = [Request(f"r{i}", list(prompt), sampling) for i, prompt in enumerate(prompts)]
    outputs = engine.run_to_completion(requests)
    assert scheduler.kv.pool.num_free == 96
    return {tuple(r.prompt_token_ids): r.all_token_ids for r in requests}, outputs, runner


@pytest.mark.parametrize("path", list(PATHS))
def test_greedy_output_is_identical_with_verified_drafts(tiny, path):
    if path != "reference" and not cpu_ops_available():
        pytest.skip("compiled CPU ops not built")
    options = PATHS[path]
    max_tokens = 12 if path == "triton" else 24  # the interpreter is slow: 12 is still several verify steps of 6
    expected, _, _ = generate(tiny, options, PROMPTS, max_tokens=max_tokens)
    for error_rate in (0.3,) if path == "triton" else (0.0, 0.3, 1.0):
        speculation = Speculation(OracleProposer(expected, error_rate, seed=1), 6)
        got, outputs, _ = generate(tiny, options, PROMPTS, speculation, max_tokens=max_tokens)
        assert got == expected, (path, error_rate)
        assert speculation.num_draft_tokens > 0
        if error_rate < 1.0:
            assert speculation.num_accepted_tokens > 0
            assert max(len(o.new_token_ids) for outs in outputs.values() for o in outs) > 1
        else:
            assert speculation.num_accepted_tokens == 0


def test_ngram_drafts_on_a_repeating_prompt(tiny):
    from scheduler.speculation import NgramProposer

    options = PATHS["reference"]
    prompt = [[11, 12, 13, 14, 15, 16] * 5]
    expected, _, _ = generate(tiny, options, prompt, max_tokens=40)
    speculation = Speculation(NgramProposer(), 6)
    got, _, _ = generate(tiny, options, prompt, speculation, max_tokens=40)
    assert got == expected and speculation.num_draft_tokens > 0


def test_sampled_requests_verify_through_the_rejection_sampler(tiny):
    """temperature > 0: drafts go through the rejection sampler (its distribution: tests/worker/sampling/
    test_speculative.py); the greedy oracle's drafts are accepted while the sampled text stays greedy."""
    options = PATHS["reference"]
    expected, _, _ = generate(tiny, options, PROMPTS)
    speculation = Speculation(OracleProposer(expected, 0.0), 6)
    params = SamplingParams(temperature=0.05, max_tokens=24)
    got, _, _ = generate(tiny, options, PROMPTS, speculation, params=params)
    assert all(len(tokens) == len(prompt) + 24 for prompt, tokens in zip(PROMPTS, got.values()))
    assert 0 < speculation.num_accepted_tokens <= speculation.num_draft_tokens


@pytest.mark.parametrize("path", ["reference", "cpu-default", "triton"])
def test_seeded_sampling_gives_the_same_tokens_with_verified_drafts(tiny, path):
    """A seeded request at temperature > 0 keeps its output token for token however many of the oracle's drafts
    (30% wrong) each step verifies: a draft is accepted when it is the path's own seeded draw there."""
    if path != "reference" and not cpu_ops_available():
        pytest.skip("compiled CPU ops not built")
    options = PATHS[path]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=10 if path == "triton" else 24)
    expected, _, _ = generate(tiny, options, PROMPTS, params=params)
    speculation = Speculation(OracleProposer(expected, 0.3, seed=4), 6)
    got, _, _ = generate(tiny, options, PROMPTS, speculation, params=params)
    assert got == expected and speculation.num_accepted_tokens > 0


def test_penalized_greedy_requests_verify_exactly(tiny):
    """Repetition, presence and frequency penalties count the drafts before each verified row."""
    options = PATHS["cpu-default"]
    params = SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.4)
    expected, _, _ = generate(tiny, options, PROMPTS, params=params)
    speculation = Speculation(OracleProposer(expected, 0.2, seed=5), 6)
    got, _, _ = generate(tiny, options, PROMPTS, speculation, params=params)
    assert got == expected and speculation.num_accepted_tokens > 0


def test_logprobs_of_every_verified_token(tiny):
    """A request asking for logprobs gets one per token, accepted drafts included, equal to decoding one token at
    a time (the same raw distribution, read from the verified rows)."""
    options = PATHS["reference"]
    params = SamplingParams(temperature=0.0, max_tokens=20, logprobs=3)
    expected, plain_outputs, _ = generate(tiny, options, PROMPTS, params=params)
    speculation = Speculation(OracleProposer(expected, 0.2, seed=9), 6)
    got, outputs, _ = generate(tiny, options, PROMPTS, speculation, params=params)
    assert got == expected and speculation.num_accepted_tokens > 0
    for request_id, request_outputs in outputs.items():
        logprobs = [entry for output in request_outputs for entry in output.logprobs]
        plain = [entry for output in plain_outputs[request_id] for entry in output.logprobs]
        assert len(logprobs) == len(plain) == 20
        for entry, want in zip(logprobs, plain):
            assert abs(entry.logprob - want.logprob) < 1e-4
            assert [token for token, _ in entry.top] == [token for token, _ in want.top] and len(entry.top) == 3


@pytest.mark.parametrize("flavour", ["qwen3", "gemma2", "mistral_window"])
def test_greedy_identity_on_other_architectures(tmp_path, flavour):
    """q/k norms (qwen3), soft-caps and alternating local/global layers (gemma2), a sliding window on every
    layer, whose pages the scheduler gives back as the window moves (mistral_window): verified drafts change
    nothing, on the path `tokenmill serve` runs by default on CPU."""
    folder, _ = make_tiny_hf_model(tmp_path, flavour)
    model = load_model(folder, progress=False)
    options = PATHS["cpu-default"]
    prompts = [[(7 * i + 3) % 200 + 1 for i in range(n)] for n in (5, 13, 30)] + PROMPTS
    expected, _, _ = generate(model, options, prompts, max_tokens=32)
    speculation = Speculation(OracleProposer(expected, 0.3, seed=2), 6)
    got, _, _ = generate(model, options, prompts, speculation, max_tokens=32)
    assert got == expected and speculation.num_accepted_tokens > 0
