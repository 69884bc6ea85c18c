"""gateway.generation.generations: the one route choice every API makes, driven here as the APIs drive it
(Generations.stream(prepared, call)) against the shared cluster's real scheduler and real Redis
(tests/gateway/conftest.py): with Redis a one-sample request runs resumable (its token stream written),
a client-chosen id is claimed (the same request attaches, another is refused), a resume index attaches
from there; n > 1 runs its samples and refuses resume naming the client's field; without Redis the plain
stream runs and resume is Unavailable. What streams is known by id (owner, sample group) whichever API
sent it: before the one choice only tokenmill.v1 registered its streams."""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest
import redis.asyncio as redis_asyncio

from core.errors import InvalidArgument, Unavailable
from gateway.generation.context import CallContext
from gateway.generation.generations import Generations
from gateway.generation.id_claims import RequestIdTaken
from gateway.generation.redis_readers import RedisReaders
from gateway.prepare.request_builder import prepare_request
from gateway.prepare.validation import ClientSampling, Limits
from gateway.text.tokenizer import load_tokenizer
from gateway.upstream.scheduler_client import SchedulerClient
from kvstore.token_streams import token_stream_key

PROMPT = [12, 34, 56, 78, 90]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture
async def scheduler(gateway_cluster):
    client = SchedulerClient(gateway_cluster.scheduler_address)
    yield client
    await client.close()


@pytest.fixture
async def redis_readers(gateway_cluster):
    readers = RedisReaders(gateway_cluster.effective_redis_url, scheduler_wait_s=5.0)
    await readers.start()
    yield readers
    await readers.aclose()


@pytest.fixture
async def redis_client(gateway_cluster):
    client = redis_asyncio.Redis.from_url(gateway_cluster.effective_redis_url)
    yield client
    await client.aclose()


def prepared(tokenizer, request_id: str, n: int | None = None, seed: int = 0):
    sampling = ClientSampling(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, seed=seed)
    return prepare_request(PROMPT, tokenizer, Limits(max_model_len=2048, vocab_size=tokenizer.vocab_size),
                           sampling=sampling, request_id=request_id, n=n)


async def collect(deltas) -> list:
    async with contextlib.aclosing(deltas):
        return [delta async for delta in deltas]


def token_ids(deltas) -> list[int]:
    return [token_id for delta in deltas for token_id in delta.token_ids]


async def test_with_redis_a_chosen_id_is_claimed_attached_to_and_resumed(tokenizer, scheduler, redis_readers,
                                                                        redis_client):
    generations = Generations(tokenizer, scheduler, redis_readers.state_reader, redis_readers.resume)
    request_id = f"routes-{uuid.uuid4().hex}"
    request = prepared(tokenizer, request_id)
    chosen = CallContext(time.monotonic(), chosen_id=True)
    first = await collect(generations.stream(request, chosen))
    assert len(token_ids(first)) == MAX_TOKENS and first[-1].finish is not None
    assert await redis_client.exists(token_stream_key(request_id)), "resumable: the scheduler wrote its tokens"
    # the same request under the same id again: it attaches to the one that ran, it does not run twice
    again = await collect(generations.stream(request, chosen))
    assert token_ids(again) == token_ids(first)
    resumed = await collect(generations.stream(request, CallContext(time.monotonic(), chosen_id=True, resume_from=2)))
    assert token_ids(resumed) == token_ids(first)[2:]
    with pytest.raises(RequestIdTaken):  # another request under a taken id
        await collect(generations.stream(prepared(tokenizer, request_id, seed=1), chosen))


async def test_n_samples_run_side_by_side_known_by_the_id_and_refuse_resume(tokenizer, scheduler, redis_readers):
    generations = Generations(tokenizer, scheduler, redis_readers.state_reader, redis_readers.resume)
    request_id = f"samples-{uuid.uuid4().hex}"
    deltas = generations.stream(prepared(tokenizer, request_id, n=2), CallContext(time.monotonic(), owner="alice"))
    async with contextlib.aclosing(deltas):
        first = await anext(deltas)
        # while it streams, whichever API sent it: its samples and its owner are known by the client's id
        assert generations.sample_groups.live(request_id).sample_ids == [f"{request_id}-0", f"{request_id}-1"]
        assert await generations.owners.owner_of(request_id) == "alice"
        rest = [delta async for delta in deltas]
    assert {delta.index for delta in [first, *rest]} == {0, 1}
    assert sum(delta.finish is not None for delta in [first, *rest]) == 2
    assert generations.sample_groups.live(request_id) is None
    assert not generations.is_resumable(prepared(tokenizer, request_id, n=2))
    with pytest.raises(InvalidArgument, match="Last-Event-ID.*cannot be resumed"):
        await collect(generations.stream(prepared(tokenizer, request_id, n=2),
                                         CallContext(time.monotonic(), resume_from=1, resume_field="Last-Event-ID")))


async def test_without_redis_the_plain_stream_runs_and_resume_is_unavailable(tokenizer, scheduler, redis_client):
    generations = Generations(tokenizer, scheduler)
    request_id = f"plain-{uuid.uuid4().hex}"
    deltas = await collect(generations.stream(prepared(tokenizer, request_id),
                                              CallContext.at_edge(time.monotonic(), timeout_s=60.0)))
    assert len(token_ids(deltas)) == MAX_TOKENS and deltas[-1].finish is not None
    assert not generations.is_resumable(prepared(tokenizer, request_id))
    await asyncio.sleep(0.2)  # the scheduler's writes are batched
    assert not await redis_client.exists(token_stream_key(request_id)), "not resumable: no token stream"
    with pytest.raises(Unavailable, match="resume_from_index needs Redis"):
        await collect(generations.stream(prepared(tokenizer, request_id), CallContext(time.monotonic(), resume_from=2)))


async def test_a_stream_interval_sends_the_same_tokens_in_fewer_messages(tokenizer, scheduler):
    """--stream-interval 4 on the plain route: the first token at once, then messages of 4 or more tokens
    (fewer when the stream ends), the same greedy tokens and text as one message per token."""
    every_token = await collect(Generations(tokenizer, scheduler).stream(
        prepared(tokenizer, f"interval-1-{uuid.uuid4().hex}"), CallContext(time.monotonic())))
    chunked = await collect(Generations(tokenizer, scheduler, stream_interval=4).stream(
        prepared(tokenizer, f"interval-4-{uuid.uuid4().hex}"), CallContext(time.monotonic())))
    assert token_ids(chunked) == token_ids(every_token) and len(token_ids(chunked)) == MAX_TOKENS
    assert "".join(delta.text for delta in chunked) == "".join(delta.text for delta in every_token)
    assert len(chunked) <= 3 and all(len(delta.token_ids) >= 4 for delta in chunked[1:-1])
    assert chunked[-1].finish is not None
