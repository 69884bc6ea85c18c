"""Overload against the running cluster: the scheduler's bounded waiting queue (by requests and by
tokens) and the gateway's per-key rate limit answer RESOURCE_EXHAUSTED at once, with retry information;
1,000 concurrent streaming clients each end with a result or a clear refusal; the cluster serves after."""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.guarded.conftest import (LIMITED_BURST, LIMITED_KEY, LIMITED_RATE, MAIN_KEY, MAX_NUM_SEQS,
                                        MAX_WAITING_REQUESTS, MAX_WAITING_TOKENS, assert_all_healthy)

MAIN = (("authorization", f"Bearer {MAIN_KEY}"),)
LIMITED = (("authorization", f"Bearer {LIMITED_KEY}"),)


def generate(prompt: str, max_tokens: int, request_id: str = "") -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt, request_id=request_id, parameters=generation_pb2.GenerateParameters(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def http_get(address: str, path: str, key: str) -> tuple[int, dict, dict]:
    request = urllib.request.Request(f"http://{address}{path}", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


async def wait_for_load(scheduler, running: int, waiting: int) -> scheduler_pb2.GetLoadResponse:
    for _ in range(600):
        load = await scheduler.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10)
        if load.num_running_requests == running and load.num_waiting_requests == waiting:
            return load
        await asyncio.sleep(0.02)
    raise AssertionError(f"scheduler never reached {running} running / {waiting} waiting: {load}")


async def refusal(call) -> grpc.aio.AioRpcError:
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert time.monotonic() - started < 5.0  # at once, not after a wait in the queue
    return caught.value


async def test_bounded_waiting_queue_refuses_at_once_naming_the_limit(guarded):
    config = guarded.config
    async with grpc.aio.insecure_channel(config.gateway_address) as channel, \
            grpc.aio.insecure_channel(config.scheduler_address) as scheduler_channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        scheduler = scheduler_pb2_grpc.SchedulerStub(scheduler_channel)
        # long requests fill the running batch; everything after them waits
        held = [stub.GenerateStream(generate("hold", 500, f"hold-{i}"), metadata=MAIN) for i in range(MAX_NUM_SEQS)]
        for call in held:
            await call.read()  # its first token: it runs
        big = stub.GenerateStream(generate("b" * 399, 2, "big"), metadata=MAIN)  # ~400 prompt tokens
        await wait_for_load(scheduler, MAX_NUM_SEQS, 1)
        too_many_tokens = await refusal(stub.Generate(generate("c" * 299, 2), metadata=MAIN))
        assert too_many_tokens.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"--max-waiting-tokens={MAX_WAITING_TOKENS}" in too_many_tokens.details()
        small = [stub.GenerateStream(generate("s", 2, f"small-{i}"), metadata=MAIN)
                 for i in range(MAX_WAITING_REQUESTS - 1)]
        await wait_for_load(scheduler, MAX_NUM_SEQS, MAX_WAITING_REQUESTS)
        too_many = await refusal(stub.Generate(generate("one more", 2), metadata=MAIN))
        assert too_many.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{MAX_WAITING_REQUESTS} requests waiting, --max-waiting-requests={MAX_WAITING_REQUESTS}" \
            in too_many.details()
        assert int(dict(too_many.trailing_metadata())["retry-after-ms"]) > 0
        # the same refusal on HTTP: 429 with Retry-After
        status, body, headers = await asyncio.to_thread(
            _post_completion, config.http_address, {"prompt": "one more", "max_tokens": 2})
        assert status == 429 and "--max-waiting-requests" in body["error"]["message"] and int(headers["Retry-After"]) >= 1
        for call in held:
            call.cancel()
        for call in [big, *small]:  # the waiting ones run once the held ones are gone
            messages = [message async for message in call]
            assert messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        await wait_for_load(scheduler, 0, 0)


def _post_completion(address: str, body: dict) -> tuple[int, dict, dict]:
    request = urllib.request.Request(f"http://{address}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {MAIN_KEY}",
                                              "Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


async def test_rate_limit_per_key_answers_resource_exhausted_with_retry_after(guarded):
    config = guarded.config
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        info = common_pb2.GetModelInfoRequest()
        for _ in range(LIMITED_BURST):
            await stub.GetModelInfo(info, metadata=LIMITED, timeout=10)
        call = stub.GetModelInfo(info, metadata=LIMITED, timeout=10)
        refused = await refusal(call)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"rate limit of API key 'limited' exceeded: {LIMITED_RATE:g} requests/s, burst {LIMITED_BURST}" \
            in refused.details()
        retry_after_ms = int(dict(refused.trailing_metadata())["retry-after-ms"])
        assert 0 < retry_after_ms <= 1000 / LIMITED_RATE
        # another key's bucket is its own
        reply = await stub.Generate(generate("hi", 2), metadata=MAIN, timeout=30)
        assert len(reply.token_ids) == 2
    status, body, headers = await asyncio.to_thread(http_get, config.http_address, "/v1/models", LIMITED_KEY)
    assert status == 429 and "rate limit of API key 'limited'" in body["error"]["message"]
    assert 1 <= int(headers["Retry-After"]) <= 1 / LIMITED_RATE + 1


NUM_CLIENTS = 1000


async def test_1000_concurrent_streaming_clients_complete_or_are_refused_clearly(guarded):
    config = guarded.config
    channels = [grpc.aio.insecure_channel(config.gateway_address) for _ in range(10)]
    stubs = [generation_pb2_grpc.GenerationStub(channel) for channel in channels]

    async def client(index: int) -> str:
        call = stubs[index % len(stubs)].GenerateStream(generate(f"client {index}", 3), metadata=MAIN, timeout=120)
        try:
            messages = [message async for message in call]
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-waiting-requests" in error.details():
                return "refused: queue full"
            return f"{error.code().name}: {error.details()}"
        done = messages[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        return "completed" if done and sum(len(m.token_ids) for m in messages) == 3 else f"bad stream {messages}"

    started = time.monotonic()
    try:
        outcomes = await asyncio.gather(*(client(i) for i in range(NUM_CLIENTS)))
    finally:
        for channel in channels:
            await channel.close()
    elapsed = time.monotonic() - started
    counts = {outcome: outcomes.count(outcome) for outcome in set(outcomes)}
    print(f"{NUM_CLIENTS} concurrent streams in {elapsed:.1f} s: {counts}")
    assert set(counts) <= {"completed", "refused: queue full"}, counts
    assert counts.get("completed", 0) >= MAX_NUM_SEQS + MAX_WAITING_REQUESTS and counts.get("refused: queue full")
    # and the gateway keeps serving
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        reply = await generation_pb2_grpc.GenerationStub(channel).Generate(generate("after", 3), metadata=MAIN,
                                                                            timeout=30)
    assert len(reply.token_ids) == 3
    assert_all_healthy(guarded)
