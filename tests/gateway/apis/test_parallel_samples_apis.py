"""n > 1 and best_of through the real cluster of tests/gateway/conftest.py (default model, 16-token pages,
prefix caching on): the unmodified openai client on completions and chat (whole and streamed) and
tokenmill.v1 over gRPC. The samples share the prompt's pages: of n samples of a fresh prompt one
computes it and the others compute only its last partial page."""
from __future__ import annotations

import time
import uuid

import grpc
import openai
import pytest

from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16  # ClusterConfig's default page size
CHAT = [{"role": "user", "content": "Write a word."}]


@pytest.fixture(scope="module")
def stub(gateway_cluster):
    with grpc.insecure_channel(gateway_cluster.gateway_address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def fresh_prompt() -> str:
    """A prompt no earlier request put in the prefix cache, some forty tokens long."""
    return f"Request {uuid.uuid4().hex}: list the planets of the solar system in order, then say why."


def cumulative(choice) -> float:
    return sum(choice.logprobs.token_logprobs)


def test_n_samples_with_a_seed_are_reproducible_and_differ(client, model):
    def sample(**extra):
        return client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=1.0,
                                         seed=1234, logprobs=0, **extra)

    first, again, single = sample(n=3), sample(n=3), sample()
    assert [choice.index for choice in first.choices] == [0, 1, 2]
    texts = [choice.text for choice in first.choices]
    assert texts == [choice.text for choice in again.choices]  # each sample's own seed stream
    assert len(set(texts)) > 1  # ... and they are different streams
    assert texts[0] == single.choices[0].text  # sample 0 draws from the seed itself
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert first.usage.completion_tokens == sum(len(choice.logprobs.tokens) for choice in first.choices)


def test_the_prompt_is_computed_once_across_samples(stub):
    request = generation_pb2.GenerateRequest(prompt=fresh_prompt(), parameters=generation_pb2.GenerateParameters(
        max_tokens=3, temperature=1.0, n=3))
    reply = stub.Generate(request, timeout=120)
    assert [choice.index for choice in reply.choices] == [0, 1, 2]
    prompt_len = reply.usage.prompt_tokens
    assert prompt_len > 2 * BLOCK_SIZE
    # one sample computed the whole prompt; the others found its full pages cached and computed only
    # the last partial page (the last token at least: its logits are sampled)
    full_pages = (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE
    cached = sorted(choice.usage.cached_prompt_tokens for choice in reply.choices)
    assert cached == [0, full_pages, full_pages]
    computed = sum(choice.usage.prompt_tokens - choice.usage.cached_prompt_tokens for choice in reply.choices)
    assert computed == prompt_len + 2 * (prompt_len - full_pages)
    assert reply.usage.cached_prompt_tokens == 0  # the request's prompt: computed (once)
    assert reply.usage.completion_tokens == sum(choice.usage.completion_tokens for choice in reply.choices)
    assert (reply.text, list(reply.token_ids)) == (reply.choices[0].text, list(reply.choices[0].token_ids))
    assert all(choice.finish_reason for choice in reply.choices)


def test_best_of_returns_the_samples_with_the_highest_cumulative_logprob(client, model):
    def sample(**extra):
        return client.completions.create(model=model, prompt="My favourite food is", max_tokens=5,
                                         temperature=1.0, seed=99, **extra)

    every = sample(n=3, logprobs=0).choices  # the same three seed streams best_of draws
    ranked = sorted(every, key=cumulative, reverse=True)
    best = sample(n=2, best_of=3, logprobs=0).choices
    assert [choice.index for choice in best] == [0, 1]
    assert [choice.text for choice in best] == [choice.text for choice in ranked[:2]]
    for got, want in zip(best, ranked):
        assert cumulative(got) == pytest.approx(cumulative(want), abs=1e-3)
    plain = sample(n=1, best_of=3).choices  # ranked by logprobs it did not ask for, which it does not get
    assert plain[0].text == ranked[0].text and plain[0].logprobs is None


def test_chat_streams_each_choice_under_its_index(client, model):
    options = dict(model=model, messages=CHAT, max_tokens=4, temperature=1.0, seed=5, n=2)
    whole = client.chat.completions.create(**options)
    texts, roles, finishes, usage = {0: "", 1: ""}, [], {}, None
    for chunk in client.chat.completions.create(**options, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.append(choice.index)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert sorted(roles) == [0, 1] and sorted(finishes) == [0, 1]
    assert texts == {choice.index: choice.message.content for choice in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("extra, param, words", [
    ({"n": 2, "best_of": 3, "stream": True}, "best_of", "when streaming"),
    ({"n": 3, "best_of": 2}, "best_of", ">= n (3)"),
    ({"n": 0}, "n", "[1, 16]"),
])
def test_sample_counts_are_validated(client, model, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt="Hi", max_tokens=2, **extra)
    assert caught.value.param == param and words in caught.value.message


def test_grpc_stream_tags_each_sample_and_refuses_unstreamable_best_of(stub):
    parameters = generation_pb2.GenerateParameters(max_tokens=3, temperature=1.0, seed=3, n=2)
    request = generation_pb2.GenerateRequest(prompt="Hello there", parameters=parameters, request_id="samples-1")
    messages = list(stub.GenerateStream(request, timeout=120))
    assert {message.request_id for message in messages} == {"samples-1"}
    ended = {message.index: message for message in messages if message.finish_reason}
    assert sorted(ended) == [0, 1]
    whole = stub.Generate(generation_pb2.GenerateRequest(prompt="Hello there", parameters=parameters), timeout=120)
    for choice in whole.choices:
        streamed = [message for message in messages if message.index == choice.index]
        assert "".join(message.text for message in streamed) == choice.text
        assert ended[choice.index].usage.completion_tokens == choice.usage.completion_tokens
    parameters.best_of = 3
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.GenerateStream(generation_pb2.GenerateRequest(prompt="Hi", parameters=parameters), timeout=60))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "best_of" in caught.value.details()


def test_cancel_request_with_the_client_id_cancels_every_sample(stub):
    request_id = f"cancel-samples-{uuid.uuid4().hex[:8]}"
    parameters = generation_pb2.GenerateParameters(max_tokens=400, temperature=1.0, ignore_eos=True, n=2)
    call = stub.GenerateStream(generation_pb2.GenerateRequest(prompt="Count to a thousand:", parameters=parameters,
                                                              request_id=request_id), timeout=120)
    next(call)
    reply = stub.CancelRequest(generation_pb2.CancelRequestRequest(request_id=request_id), timeout=30)
    assert reply.cancelled and reply.status == generation_pb2.REQUEST_STATUS_CANCELLED
    ended = {message.index: message for message in call if message.finish_reason}  # the aborts, not a status
    assert {index: message.finish_reason for index, message in ended.items()} == {
        0: common_pb2.FINISH_REASON_ABORT, 1: common_pb2.FINISH_REASON_ABORT}
    assert all(message.usage.completion_tokens < 400 for message in ended.values())
    deadline = time.monotonic() + 10  # the scheduler writes the samples' records a moment after
    while (status := stub.GetRequestStatus(generation_pb2.GetRequestStatusRequest(request_id=request_id),
                                           timeout=10)).status != generation_pb2.REQUEST_STATUS_CANCELLED:
        assert time.monotonic() < deadline, status
        time.sleep(0.05)
    assert status.request_id == request_id and status.num_output_tokens < 800
