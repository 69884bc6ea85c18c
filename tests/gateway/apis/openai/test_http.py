"""The gateway's OpenAI-compatible HTTP API driven by the unmodified `openai` package against a real
cluster (tests/gateway/conftest.py), plus an in-process server on the same scheduler for auth and a dead
scheduler for 503."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from gateway.apis.served_model import ServedModel
from gateway.generation.generations import Generations
from gateway.apis.openai.http import OpenAIHTTP, start_http
from gateway.upstream.scheduler_client import SchedulerClient
from gateway.text.tokenizer import load_tokenizer
from gateway.prepare.validation import Limits
from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tokenmill.cluster.readiness import free_port

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colours."}]


def prompt_tokens(config, **request) -> int:
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return len(stub.Tokenize(generation_pb2.TokenizeRequest(**request)).token_ids)


def test_models_health_and_ready(gateway_cluster, client, model):
    models = client.models.list().data
    assert [m.id for m in models] == [model] and model == client.models.retrieve(model).id
    card = client.models.retrieve(model).model_extra  # the model's own facts (issue 16 item 3)
    assert (card["architecture"], card["max_context_length"], card["dtype"]) == ("llama", 8192, "float32")
    # the default GGUF runs as it is stored (issue 15 item 1): its formats, as the worker reports them
    assert card["quantization"] == "Q4_1, Q8_0" and card["max_model_len"] <= card["max_context_length"]
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4")
    assert caught.value.code == "model_not_found"
    for path, want in (("/health", "ok"), ("/ready", "ready")):
        with urllib.request.urlopen(f"http://{gateway_cluster.http_address}{path}", timeout=10) as reply:
            assert reply.status == 200 and json.load(reply)["status"] == want


def test_completion_stream_equals_whole_and_usage_counts_tokens(gateway_cluster, client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    choice = whole.choices[0]
    assert text == choice.text and "Paris" in text
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion" and whole.model == model
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id != whole.id
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and set(finishes[:-1]) == {None}
    assert whole.usage.prompt_tokens == prompt_tokens(gateway_cluster, text=PROMPT, add_special_tokens=True)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    if choice.finish_reason == "length":
        assert whole.usage.completion_tokens == 12
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # include_usage: a last usage chunk
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream_equals_whole_with_role_first(gateway_cluster, client, model):
    whole = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=16,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    message = whole.choices[0].message
    assert message.role == "assistant" and text == message.content and len(text) > 5
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # usage only when stream_options asks for it
    chat_ids = prompt_tokens(gateway_cluster, messages=generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(**turn) for turn in CHAT]))
    assert whole.usage.prompt_tokens == chat_ids


def test_stop_string_and_max_tokens_finish_reasons(client, model):
    full = client.completions.create(model=model, prompt="Count from 1 to 20: 1, 2,", max_tokens=30,
                                     temperature=0).choices[0].text
    stop = full[len(full) // 2:][:3]
    cut = client.completions.create(model=model, prompt="Count from 1 to 20: 1, 2,", max_tokens=30,
                                    temperature=0, stop=[stop, "zzz"]).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    short = client.chat.completions.create(model=model, messages=CHAT, max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 3


def test_seed_reproduces_sampling_at_temperature_one(client, model):
    def sample(seed: int) -> str:
        return client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_logprobs_shapes(client, model):
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True}).choices[0]
    logprobs = completion.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == completion.text and logprobs.text_offset[0] == 0
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert 1 <= len(top) <= 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)  # greedy: the chosen token is the best
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    content = chat.logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(bytes(entry.bytes) == entry.token.encode() for entry in content)
    assert "".join(entry.token for entry in content) == chat.message.content
    assert client.chat.completions.create(model=model, messages=CHAT, max_tokens=2).choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_errors_in_openai_shape(client, model, stream):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=PROMPT, temperature=-1, stream=stream)
    error = caught.value
    assert error.status_code == 400 and error.param == "temperature" and error.type == "invalid_request_error"
    assert "temperature=-1" in error.message and "[0, 100]" in error.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=CHAT, n=17, stream=stream)
    assert caught.value.param == "n" and "n=17" in caught.value.message and "[1, 16]" in caught.value.message
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, stream=stream)
    assert caught.value.code == "model_not_found" and model in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=10**6, stream=stream)
    assert caught.value.param == "max_completion_tokens"


async def test_client_disconnect_mid_stream_aborts_and_frees_pages(gateway_cluster, model):
    client = openai.AsyncOpenAI(base_url=f"http://{gateway_cluster.http_address}/v1", api_key="x", max_retries=0)
    async with grpc.aio.insecure_channel(gateway_cluster.scheduler_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        stream = await client.completions.create(model=model, prompt="Tell me a long story.", max_tokens=400,
                                                 stream=True, extra_body={"ignore_eos": True})
        received = 0
        async for chunk in stream:
            received += 1
            if received == 3:
                load = await scheduler.GetLoad(scheduler_pb2.GetLoadRequest(include_running_request_ids=True))
                assert chunk.id in load.running_request_ids and load.num_kv_pages_used > 0
                await stream.close()  # drops the connection mid-body
                break
        for _ in range(100):
            load = await scheduler.GetLoad(scheduler_pb2.GetLoadRequest(include_running_request_ids=True))
            if load.num_running_requests == 0 and load.num_kv_pages_used == 0:
                break
            await asyncio.sleep(0.05)
        assert load.num_running_requests == 0 and load.num_kv_pages_used == 0
    await client.close()


async def _local_server(scheduler_address: str, api_key: str = ""):
    """The HTTP API in this process on a scheduler of our choice (a real one, or none at all)."""
    scheduler = SchedulerClient(scheduler_address)
    info = common_pb2.GetModelInfoResponse(model_config=common_pb2.ModelConfig(name="m", max_context_length=2048))
    tokenizer = await asyncio.to_thread(load_tokenizer, None)
    limits = Limits(max_model_len=2048, vocab_size=tokenizer.vocab_size)
    api = OpenAIHTTP(ServedModel(Generations(tokenizer, scheduler), info, limits), api_key=api_key)
    port = free_port("127.0.0.1")
    runner = await start_http(api, "127.0.0.1", port)
    return runner, scheduler, f"http://127.0.0.1:{port}/v1"


async def test_api_key_is_required_when_configured(gateway_cluster):
    runner, scheduler, base_url = await _local_server(gateway_cluster.scheduler_address, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError) as caught:
            await openai.AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
        assert caught.value.status_code == 401 and caught.value.code == "invalid_api_key"
        with pytest.raises(urllib.error.HTTPError) as caught:  # no header at all (openai always sends one)
            await asyncio.to_thread(urllib.request.urlopen, f"{base_url}/models", timeout=10)
        assert caught.value.code == 401
        assert "Authorization: Bearer" in json.loads(caught.value.read())["error"]["message"]
        good = openai.AsyncOpenAI(base_url=base_url, api_key="s3cret", max_retries=0)
        reply = await good.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0)
        assert reply.usage.completion_tokens >= 1
    finally:
        await runner.cleanup()
        await scheduler.close()


async def test_unreachable_scheduler_is_503(unused_tcp_port):
    runner, scheduler, base_url = await _local_server(f"127.0.0.1:{unused_tcp_port}")
    try:
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as caught:
            await openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0).completions.create(
                model="m", prompt=PROMPT, max_tokens=2, stream=True)
        assert caught.value.status_code == 503 and caught.value.code == "service_unavailable"
        assert "unavailable" in caught.value.message and time.monotonic() - started < 30
    finally:
        await runner.cleanup()
        await scheduler.close()


async def test_deeply_nested_json_is_400_and_a_non_json_content_type_is_415(unused_tcp_port):
    # both are refused before any scheduler is asked, so a dead one will do
    runner, scheduler, base_url = await _local_server(f"127.0.0.1:{unused_tcp_port}")

    def post(body: bytes, content_type: str) -> tuple[int, str]:
        request = urllib.request.Request(f"{base_url}/completions", data=body, method="POST",
                                         headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())["error"]["message"]

    try:
        status, message = await asyncio.to_thread(post, b"[" * 100_000 + b"]" * 100_000, "application/json")
        assert status == 400 and "nests arrays or objects deeper" in message
        body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 2}).encode()
        for content_type in ("text/plain", "application/x-www-form-urlencoded"):
            status, message = await asyncio.to_thread(post, body, content_type)
            assert status == 415 and f"Content-Type '{content_type}' is not JSON" in message
    finally:
        await runner.cleanup()
        await scheduler.close()
