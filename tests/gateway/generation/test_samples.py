"""gateway.generation.samples on a scripted scheduler: sibling ids and seeds, one route for all samples,
best_of's ranking by cumulative logprob, and every sibling cancelled when one fails or the caller leaves.
No cluster (tests/gateway/apis/test_parallel_samples_apis.py runs the real one)."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from core.errors import InvalidArgument, ResourceExhausted
from core.outputs import FinishReason, RequestOutput
from core.step import TokenLogprobs
from gateway.generation.context import CallContext, SchedulerSide
from gateway.generation.samples import check_streamable, sample_requests, stream_samples
from gateway.upstream.circuit_breaker import CircuitBreaker
from gateway.prepare.request_builder import prepare_request
from gateway.text.tokenizer import load_tokenizer
from gateway.prepare.validation import ClientSampling, Limits

LIMITS = Limits(max_model_len=2048, vocab_size=49152)
PROMPT = [12, 34, 56]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


class ScriptedScheduler:
    """route() -> itself; each submit plays its sample's script: (token id, logprob) pairs, then the end,
    or an exception at that point, or for ever (None) until cancelled."""

    def __init__(self, scripts: dict[int, list | None]) -> None:
        self.scripts = scripts  # sample index -> its script
        self.breaker = CircuitBreaker("scripted scheduler")
        self.routes = 0
        self.submitted = []
        self.cut: list[str] = []  # samples whose call was closed before their end

    def route(self, prompt_token_ids):
        self.routes += 1
        return self

    async def submit(self, request, **options):
        self.submitted.append(request)
        script = self.scripts[int(request.request_id.rsplit("-", 1)[1])]
        ended = False
        try:
            if script is None:
                await asyncio.Event().wait()
            for count, step in enumerate(script, 1):
                await asyncio.sleep(0)
                if isinstance(step, Exception):
                    raise step
                token_id, logprob = step
                done = count == len(script)
                yield RequestOutput(request.request_id, [token_id], [TokenLogprobs(logprob, [])], finished=done,
                                    finish_reason=FinishReason.LENGTH if done else None,
                                    num_prompt_tokens=len(PROMPT), num_output_tokens=count)
            ended = True
        finally:
            if not ended:
                self.cut.append(request.request_id)

    async def abort(self, request_ids, reason=FinishReason.ABORT):
        return request_ids


def prepared(tokenizer, **options):
    sampling = ClientSampling(max_tokens=8, seed=options.pop("seed", None), logprobs=options.pop("logprobs", None))
    return prepare_request(PROMPT, tokenizer, LIMITS, sampling=sampling, request_id="req", **options)


def samples(request, scheduler, tokenizer):
    """stream_samples, as Generations.stream runs it for an n > 1 request (no deadline, keys off)."""
    return stream_samples(request, CallContext(time.monotonic()), SchedulerSide(tokenizer, scheduler))


async def collect(request, scheduler, tokenizer):
    deltas = samples(request, scheduler, tokenizer)
    async with contextlib.aclosing(deltas):
        return [delta async for delta in deltas]


def test_siblings_get_their_own_ids_and_seeds(tokenizer):
    samples = sample_requests(prepared(tokenizer, n=3, seed=2**64 - 2))
    assert [s.request.request_id for s in samples] == ["req-0", "req-1", "req-2"]
    assert [s.request.sampling_params.seed for s in samples] == [2**64 - 2, 2**64 - 1, 0]
    assert all(s.request.sampling_params.logprobs is None for s in samples)  # nothing to rank
    ranked = sample_requests(prepared(tokenizer, n=1, best_of=2))
    assert [s.request.sampling_params.logprobs for s in ranked] == [0, 0]  # ranked by their logprobs
    assert all(s.request.sampling_params.seed is None for s in ranked)
    single = prepared(tokenizer)
    assert sample_requests(single) == [single]  # one sample: the request itself, its own id
    with pytest.raises(InvalidArgument, match="when streaming"):
        check_streamable(prepared(tokenizer, n=1, best_of=2))


async def test_best_of_returns_the_highest_cumulative_logprobs_best_first(tokenizer):
    scheduler = ScriptedScheduler({0: [(5, -1.0), (6, -1.0)], 1: [(7, -0.5), (8, -0.2)], 2: [(9, -3.0)],
                                   3: [(10, -0.1), (11, -0.9)]})
    deltas = await collect(prepared(tokenizer, n=2, best_of=4), scheduler, tokenizer)
    assert scheduler.routes == 1  # every sample on one replica: one prefix cache
    by_index = {index: [t for d in deltas if d.index == index for t in d.token_ids] for index in (0, 1)}
    assert by_index == {0: [7, 8], 1: [10, 11]}  # -0.7 and -1.0 beat -2.0 and -3.0
    assert all(not delta.logprobs for delta in deltas)  # ranked by logprobs the client did not ask for
    with_logprobs = await collect(prepared(tokenizer, n=1, best_of=4, logprobs=0), scheduler, tokenizer)
    assert [entry.logprob for d in with_logprobs for entry in d.logprobs] == [-0.5, -0.2]


async def test_one_failing_sample_fails_the_request_and_cancels_the_others(tokenizer):
    refusal = ResourceExhausted("scheduler waiting queue is full")
    scheduler = ScriptedScheduler({0: None, 1: [(5, -1.0), refusal], 2: None})
    with pytest.raises(ResourceExhausted):
        await collect(prepared(tokenizer, n=3), scheduler, tokenizer)
    assert sorted(scheduler.cut) == ["req-0", "req-1", "req-2"]


async def test_the_caller_leaving_cancels_every_sample(tokenizer):
    scheduler = ScriptedScheduler({0: [(5, -1.0)] * 4, 1: None})
    deltas = samples(prepared(tokenizer, n=2), scheduler, tokenizer)
    first = await anext(deltas)
    assert first.index == 0 and first.request_id == "req-0"
    await deltas.aclose()
    assert sorted(scheduler.cut) == ["req-0", "req-1"]
