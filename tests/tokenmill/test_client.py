"""tokenmill.client: retries, deadlines and the no-retry-after-data rule against a scripted gRPC server
in this process (fast), then Client and AsyncClient against a real cluster on the default model (slow)."""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from concurrent import futures

import grpc
import pytest

from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tokenmill.client import AsyncClient, Client, ClientError, RetryPolicy
from tokenmill.client.types import generate_request
from tokenmill.cluster.readiness import free_port

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.01, max_backoff_s=0.05)


class ScriptedGeneration(generation_pb2_grpc.GenerationServicer):
    """Fails the first `failures` calls of each method with `fail_code`, then answers; counts calls."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.failures = 0
        self.fail_code = grpc.StatusCode.UNAVAILABLE
        self.break_after_first = False  # GenerateStream: one message, then UNAVAILABLE
        self.delay_s = 0.0

    def _enter(self, method: str, context) -> None:
        self.calls[method] += 1
        if self.calls[method] <= self.failures:
            context.abort(self.fail_code, f"scripted {self.fail_code.name} #{self.calls[method]}")
        time.sleep(self.delay_s)

    def Tokenize(self, request, context):
        self._enter("Tokenize", context)
        return generation_pb2.TokenizeResponse(token_ids=[len(request.text), 1, 2])

    def GetModelInfo(self, request, context):
        self._enter("GetModelInfo", context)
        return common_pb2.GetModelInfoResponse(model_config=common_pb2.ModelConfig(name="scripted"), block_size=16)

    def GenerateStream(self, request, context):
        self._enter("GenerateStream", context)
        yield generation_pb2.GenerateStreamResponse(request_id="r1", text="Hel", token_ids=[1])
        if self.break_after_first:
            context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: scheduler connection lost")
        yield generation_pb2.GenerateStreamResponse(
            request_id="r1", text="lo", token_ids=[2], finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=2))


def start_scripted(servicer: ScriptedGeneration, port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


@pytest.fixture
def scripted():
    servicer, port = ScriptedGeneration(), free_port("127.0.0.1")
    server = start_scripted(servicer, port)
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_backoff_grows_to_its_cap_and_jitter_only_shortens():
    plain = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0, jitter=0.0)
    assert [plain.backoff_s(i) for i in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    jittered = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, jitter=0.5)
    waits = [jittered.backoff_s(3) for _ in range(200)]
    assert all(0.4 <= wait <= 0.8 for wait in waits) and max(waits) - min(waits) > 0.1
    with pytest.raises(ValueError, match="max_attempts=0"):
        RetryPolicy(max_attempts=0)


def test_request_building_checks_parameters():
    request = generate_request([{"role": "user", "content": "hi"}], None, "", "", 0, {"stop": "\n", "seed": 0})
    assert request.WhichOneof("input") == "messages" and list(request.parameters.stop) == ["\n"]
    assert request.parameters.HasField("seed") and not request.parameters.HasField("temperature")
    with pytest.raises(TypeError, match="tempreature"):
        generate_request("hi", None, "", "", 0, {"tempreature": 0})
    with pytest.raises(TypeError, match="exactly one"):
        generate_request(None, None, "", "", 0, {})


def test_unavailable_is_retried_until_it_succeeds(scripted):
    servicer, address = scripted
    servicer.failures = 2
    with Client(address, retry=FAST_RETRY) as client:
        assert client.tokenize("abc") == [3, 1, 2]
        result = client.generate("hi")
    assert result.text == "Hello" and result.finish_reason == "length" and result.usage.completion_tokens == 2
    assert result.usage.total_tokens == 3 + 2
    assert servicer.calls == {"Tokenize": 3, "GenerateStream": 3}


def test_retries_stop_after_max_attempts_and_other_codes_are_never_retried(scripted):
    servicer, address = scripted
    servicer.failures = 10
    with Client(address, retry=RetryPolicy(max_attempts=3, initial_backoff_s=0.01)) as client:
        with pytest.raises(ClientError) as caught:
            client.model_info()
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE and caught.value.attempts == 3
        servicer.fail_code = grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(ClientError) as caught:
            client.tokenize("x")
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "scripted" in caught.value.details
    assert servicer.calls == {"GetModelInfo": 3, "Tokenize": 1}


def test_a_stream_that_already_delivered_text_is_not_retried(scripted):
    servicer, address = scripted
    servicer.break_after_first = True
    received = []
    with Client(address, retry=FAST_RETRY) as client, pytest.raises(ClientError) as caught:
        for delta in client.stream("hi"):
            received.append(delta.text)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and received == ["Hel"]
    assert servicer.calls["GenerateStream"] == 1


async def test_async_client_retries_the_same_way(scripted):
    servicer, address = scripted
    servicer.failures = 2
    async with AsyncClient(address, retry=FAST_RETRY) as client:
        assert (await client.model_info()).name == "scripted"
        assert [d.text async for d in client.stream("hi")] == ["Hel", "lo"]
        servicer.break_after_first, servicer.failures = True, 0
        with pytest.raises(ClientError) as caught:
            await client.generate("hi")
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE and caught.value.attempts == 1
    assert servicer.calls == {"GetModelInfo": 3, "GenerateStream": 4}


@pytest.mark.parametrize("method", ["tokenize", "stream"])
def test_deadline_exceeded_raises_and_is_not_retried(scripted, method):
    servicer, address = scripted
    servicer.delay_s = 1.0
    started = time.monotonic()
    with Client(address, timeout=0.2, retry=FAST_RETRY) as client, pytest.raises(ClientError) as caught:
        list(client.stream("hi")) if method == "stream" else client.tokenize("hi")
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 0.9
    assert sum(servicer.calls.values()) == 1


def test_a_server_that_starts_late_is_reached_by_retries():
    servicer, port = ScriptedGeneration(), free_port("127.0.0.1")
    servers = []
    timer = threading.Timer(0.5, lambda: servers.append(start_scripted(servicer, port)))
    timer.start()
    started = time.monotonic()
    try:
        policy = RetryPolicy(max_attempts=12, initial_backoff_s=0.05, max_backoff_s=0.3, jitter=0.0)
        with Client(f"127.0.0.1:{port}", retry=policy) as client:
            assert client.model_info().name == "scripted"
        assert time.monotonic() - started >= 0.5
    finally:
        timer.join()
        for server in servers:
            server.stop(0)


# -- against a real cluster ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster_address(default_cluster):
    return default_cluster[0].gateway_address


@pytest.mark.slow
def test_sync_client_against_the_cluster(cluster_address):
    with Client(cluster_address, timeout=120) as client:
        info = client.model_info()
        assert (info.architecture, info.vocab_size, info.kv_cache_policy) == ("llama", 49152, "paged")
        whole = client.generate("The capital of France is", max_tokens=8, temperature=0)
        deltas = list(client.stream("The capital of France is", max_tokens=8, temperature=0))
        assert "".join(d.text for d in deltas) == whole.text and "Paris" in whole.text
        assert [t for d in deltas for t in d.token_ids] == whole.token_ids
        assert deltas[-1].finish_reason == whole.finish_reason and whole.usage.completion_tokens == len(whole.token_ids)
        assert client.detokenize(client.tokenize("Hello there"), skip_special_tokens=True) == "Hello there"
        for _ in range(100):  # the record is written asynchronously
            with contextlib.suppress(ClientError):
                if client.request_status(whole.request_id).status == "finished":
                    break
            time.sleep(0.05)
        assert client.request_status(whole.request_id).num_output_tokens == len(whole.token_ids)
        with pytest.raises(ClientError) as caught:
            client.generate("Tell me a story.", max_tokens=400, ignore_eos=True, timeout=0.5)
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.slow
async def test_async_client_streams_chat_and_cancels_by_id(cluster_address):
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    async with AsyncClient(cluster_address, timeout=120) as client:
        whole = await client.generate(chat, max_tokens=10, temperature=0)
        assert "".join([d.text async for d in client.stream(messages=chat, max_tokens=10, temperature=0)]) == whole.text
        stream = client.stream("Tell me a long story.", max_tokens=400, ignore_eos=True, request_id="client-cancel")
        async with contextlib.aclosing(stream):
            first = await anext(stream)
            assert first.request_id == "client-cancel"
            assert await client.cancel("client-cancel") is True
            rest = [delta async for delta in stream]
    assert rest[-1].finish_reason == "abort" and rest[-1].usage.completion_tokens < 400
