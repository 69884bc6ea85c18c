"""gateway.generation.resume on a scripted scheduler and a real Redis: a stream whose scheduler breaks after taking
the request goes on from the request's token stream at the index already sent (no token lost or
repeated), ends UNAVAILABLE naming the flag when the stream stays quiet for the wait, and a request
refused before any scheduler took it is UNAVAILABLE at once. The live-cluster version (a real kill -9
on all three APIs) is tests/e2e/test_resume_everywhere.py."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as redis_asyncio

from core.errors import Unavailable
from core.outputs import RequestOutput
from gateway.upstream.circuit_breaker import CircuitBreaker
from gateway.prepare.request_builder import prepare_request
from gateway.generation.context import CallContext, SchedulerSide
from gateway.generation.resume import ResumeStore, submit_or_attach
from gateway.text.tokenizer import load_tokenizer
from gateway.prepare.validation import ClientSampling, Limits
from kvstore.followers import Followers, followed_key
from kvstore.state_reader import RequestStateReader
from kvstore.token_streams import TokenStreamReader, token_stream_key

PROMPT = [12, 34, 56]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


class DyingScheduler:
    """Sends `tokens`, then its call breaks UNAVAILABLE (as when the scheduler is killed); or refuses at
    once (refuse=True), as with no scheduler reachable."""

    def __init__(self, tokens: list[int], refuse: bool = False) -> None:
        self.tokens, self.refuse = tokens, refuse
        self.breaker = CircuitBreaker("dying scheduler")
        self.address = "127.0.0.1:1"
        self.aborted: list[str] = []

    def route(self, prompt_token_ids):
        if self.refuse:
            raise Unavailable("no scheduler is ready")
        return self

    async def submit(self, request, **options):
        for count, token_id in enumerate(self.tokens, 1):
            yield RequestOutput(request.request_id, [token_id], num_prompt_tokens=len(PROMPT), num_output_tokens=count)
        raise Unavailable("Stream removed (Socket closed)")

    async def abort(self, request_ids, reason=None):
        self.aborted += request_ids
        return request_ids


def _not_lost(request_id, error, accepted):
    raise AssertionError("a resumable request is not reported lost")


def _submit_or_attach(request, tokenizer, scheduler, store):
    """The route with Redis, as Generations.stream runs it (no deadline, keys off, an id of the gateway's)."""
    return submit_or_attach(request, CallContext(time.monotonic()), SchedulerSide(tokenizer, scheduler, _not_lost),
                            store)


async def _write(redis_url: str, request_id: str, index: int, token_ids: list[int], finish: str = "") -> None:
    fields = {"i": str(index), "t": " ".join(map(str, token_ids))}
    if finish:
        fields.update(f=finish, p=str(len(PROMPT)))
    client = redis_asyncio.Redis.from_url(redis_url)
    await client.xadd(token_stream_key(request_id), fields)
    await client.aclose()


def _store(redis_url: str, wait_s: float) -> ResumeStore:
    return ResumeStore(TokenStreamReader(redis_url), RequestStateReader(redis_url), followers=Followers(redis_url),
                       scheduler_wait_s=wait_s)


async def test_a_broken_stream_goes_on_from_redis_at_the_index_already_sent(fresh_redis, tokenizer):
    request = prepare_request(PROMPT, tokenizer, Limits(max_model_len=2048, vocab_size=49152),
                              sampling=ClientSampling(max_tokens=5), request_id="goes-on")
    await _write(fresh_redis, "goes-on", 0, [101, 102])  # the third token never reached Redis

    async def restarted_scheduler():  # re-admitted: recomputes index 2 (sent already), then goes on
        await asyncio.sleep(0.3)
        await _write(fresh_redis, "goes-on", 2, [103])
        await _write(fresh_redis, "goes-on", 3, [104, 105], finish="LENGTH")

    store, scheduler = _store(fresh_redis, 10.0), DyingScheduler([101, 102, 103])
    writer = asyncio.create_task(restarted_scheduler())
    deltas = [d async for d in _submit_or_attach(request, tokenizer, scheduler, store)]
    await writer
    assert [t for d in deltas for t in d.token_ids] == [101, 102, 103, 104, 105], "none lost, none repeated"
    assert deltas[-1].finish is not None and deltas[-1].finish.completion_tokens == 5
    assert not scheduler.aborted
    client = redis_asyncio.Redis.from_url(fresh_redis)
    assert await client.exists(followed_key("goes-on")), "followed: the scheduler's orphan check keeps it"
    await client.aclose()
    await store.aclose()


async def test_a_stream_that_cannot_go_on_ends_unavailable_naming_the_wait_and_is_aborted(fresh_redis, tokenizer):
    request = prepare_request(PROMPT, tokenizer, Limits(max_model_len=2048, vocab_size=49152),
                              sampling=ClientSampling(max_tokens=5), request_id="never-back")
    await _write(fresh_redis, "never-back", 0, [101])
    store, scheduler = _store(fresh_redis, 1.0), DyingScheduler([101])
    received, started = [], time.monotonic()
    with pytest.raises(Unavailable) as ended:
        async for delta in _submit_or_attach(request, tokenizer, scheduler, store):
            received += delta.token_ids
    assert received == [101] and 1.0 <= time.monotonic() - started < 5.0
    assert "--scheduler-resume-wait-s" in str(ended.value) and "Socket closed" in str(ended.value)
    await asyncio.sleep(0)  # the abort is sent in the background
    assert scheduler.aborted == ["never-back"]
    await store.aclose()


async def test_a_request_no_scheduler_took_is_unavailable_at_once(fresh_redis, tokenizer):
    request = prepare_request(PROMPT, tokenizer, Limits(max_model_len=2048, vocab_size=49152),
                              sampling=ClientSampling(max_tokens=5), request_id="never-taken")
    store, started = _store(fresh_redis, 30.0), time.monotonic()
    with pytest.raises(Unavailable, match="no scheduler is ready"):
        async for _ in _submit_or_attach(request, tokenizer, DyingScheduler([], refuse=True), store):
            pass
    assert time.monotonic() - started < 1.0, "not waited for: nothing runs under its id"
    await store.aclose()


async def test_a_hole_in_the_token_stream_ends_the_stream_unavailable_instead_of_skipping_it(fresh_redis, tokenizer):
    """Tokens 2 and 3 never reached Redis: the client gets up to the hole and an error naming it, not a
    stream that ends with length and two tokens fewer than its usage says."""
    request = prepare_request(PROMPT, tokenizer, Limits(max_model_len=2048, vocab_size=49152),
                              sampling=ClientSampling(max_tokens=5), request_id="holed")
    await _write(fresh_redis, "holed", 0, [101, 102])
    await _write(fresh_redis, "holed", 4, [105], finish="LENGTH")
    store, received = _store(fresh_redis, 10.0), []
    with pytest.raises(Unavailable, match="lacks tokens 2 to 3"):
        async for delta in _submit_or_attach(request, tokenizer, DyingScheduler([101]), store):
            received += delta.token_ids
    assert received == [101, 102]
    await store.aclose()
