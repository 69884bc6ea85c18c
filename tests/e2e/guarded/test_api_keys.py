"""API keys on every public API of a running gateway (tokenmill.v1 gRPC, KServe v2 gRPC through the
unmodified tritonclient, OpenAI HTTP): a missing, malformed or unknown key is refused with
UNAUTHENTICATED / 401 naming what was wrong and never repeating the key; health and reflection stay open."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.e2e.guarded.conftest import MAIN_KEY, OTHER_KEY
from plumbing.rpc import GENERATION_SERVICE

WRONG_KEY = "tm-wrong-key-that-must-never-be-echoed"
REFUSED = [  # (authorization value or None, what the message must say)
    (None, "missing API key"),
    (f"Bearer {WRONG_KEY}", "unknown API key"),
    (f"Basic {WRONG_KEY}", "malformed authorization"),
    (WRONG_KEY, "malformed authorization"),  # the key without its scheme
    ("Bearer ", "malformed authorization"),
]
HINT = "authorization: Bearer <key>"


def prompt_request() -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt="hi", parameters=generation_pb2.GenerateParameters(max_tokens=2,
                                                                                       ignore_eos=True))


@pytest.mark.parametrize(("authorization", "reason"), REFUSED)
def test_grpc_generation_refuses_a_missing_or_wrong_key(guarded, authorization, reason):
    metadata = () if authorization is None else (("authorization", authorization),)
    with grpc.insecure_channel(guarded.config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for call in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw)),
                     lambda r, **kw: stub.Tokenize(generation_pb2.TokenizeRequest(text="x"), **kw)):
            with pytest.raises(grpc.RpcError) as caught:
                call(prompt_request(), metadata=metadata, timeout=30)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert reason in caught.value.details() and HINT in caught.value.details()
            assert WRONG_KEY not in caught.value.details() and "wrong-key" not in caught.value.details()
        reply = stub.Generate(prompt_request(), metadata=guarded.metadata, timeout=30)
        assert len(reply.token_ids) == 2


def test_kserve_grpc_needs_the_key_too(guarded):
    client = grpcclient.InferenceServerClient(guarded.config.gateway_address)
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hello"], dtype=object))
    for headers in ({}, {"authorization": f"Bearer {WRONG_KEY}"}):
        with pytest.raises(InferenceServerException) as caught:
            client.infer("tiny-llama", [text], parameters={"max_tokens": 2}, headers=headers)
        assert caught.value.status() == "StatusCode.UNAUTHENTICATED" and WRONG_KEY not in caught.value.message()
        with pytest.raises(InferenceServerException) as caught:
            client.get_model_metadata("tiny-llama", headers=headers)
        assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
        assert client.is_server_ready(headers=headers) and client.is_model_ready("tiny-llama", headers=headers)
    result = client.infer("tiny-llama", [text], parameters={"max_tokens": 2},
                          headers={"authorization": f"Bearer {MAIN_KEY}"})
    assert result.as_numpy("text_output") is not None
    assert client.get_model_metadata("tiny-llama", headers={"authorization": f"Bearer {MAIN_KEY}"}).name
    client.close()


def test_kserve_stream_infer_needs_the_key(guarded):
    with grpc.insecure_channel(guarded.config.gateway_address) as channel:
        stream_infer = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                             request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                             response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
        with pytest.raises(grpc.RpcError) as caught:
            list(stream_infer(iter([service_pb2.ModelInferRequest(model_name="tiny-llama")]), timeout=30))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED and "missing API key" in caught.value.details()


def http(guarded, path: str, authorization: str | None, body: dict | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    request = urllib.request.Request(f"http://{guarded.config.http_address}{path}", headers=headers,
                                     data=None if body is None else json.dumps(body).encode(),
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize(("authorization", "reason"), REFUSED)
def test_openai_http_answers_401_for_a_missing_or_wrong_key(guarded, authorization, reason):
    for path, body in (("/v1/models", None), ("/v1/completions", {"prompt": "hi", "max_tokens": 2})):
        status, reply = http(guarded, path, authorization, body)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
        assert reason in reply["error"]["message"] and WRONG_KEY not in json.dumps(reply)
    status, reply = http(guarded, "/v1/completions", f"Bearer {MAIN_KEY}",
                         {"prompt": "hi", "max_tokens": 2, "ignore_eos": True})  # a random model may pick EOS
    assert status == 200 and reply["usage"]["completion_tokens"] == 2


def test_health_and_reflection_stay_open(guarded):
    with grpc.insecure_channel(guarded.config.gateway_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", GENERATION_SERVICE):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert GENERATION_SERVICE in set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert http(guarded, "/health", None)[0] == 200 and http(guarded, "/ready", None)[0] == 200


def test_the_keys_file_holds_only_hashes(guarded):
    text = open(guarded.config.gateway.api_keys_file).read()
    assert MAIN_KEY not in text and '"sha256"' in text


def test_a_request_id_answers_only_to_the_key_that_submitted_it(guarded):
    """Status, cancel and resume by id: another key is told the id is not found (the same answer as for
    an id that never existed), cannot cancel it, and cannot take the id over; the owner can do all three."""
    other = (("authorization", f"Bearer {OTHER_KEY}"),)
    request_id = "owned-by-main-7f3a"
    max_tokens = 300
    request = generation_pb2.GenerateRequest(prompt="hi", request_id=request_id, parameters=generation_pb2.GenerateParameters(
        max_tokens=max_tokens, ignore_eos=True))
    with grpc.insecure_channel(guarded.config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        stream = stub.GenerateStream(request, metadata=guarded.metadata, timeout=120)
        received = list(next(stream).token_ids)  # running now, and its record written with its owner
        for _ in range(50):  # the record is written a few ms after the request is queued
            try:
                stub.GetRequestStatus(generation_pb2.GetRequestStatusRequest(request_id=request_id),
                                      metadata=guarded.metadata, timeout=10)
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.NOT_FOUND
        refusals = {
            "status": lambda: stub.GetRequestStatus(generation_pb2.GetRequestStatusRequest(request_id=request_id),
                                                    metadata=other, timeout=10),
            "cancel": lambda: stub.CancelRequest(generation_pb2.CancelRequestRequest(request_id=request_id),
                                                 metadata=other, timeout=10),
            "resume": lambda: list(stub.GenerateStream(generation_pb2.GenerateRequest(
                prompt="hi", request_id=request_id, resume_from_index=0), metadata=other, timeout=10)),
        }
        for name, call in refusals.items():
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND, name
            assert caught.value.details() == f"request {request_id!r} not found", name
        with pytest.raises(grpc.RpcError) as caught:  # the same id sent again by another key: taken, not shared
            stub.Generate(request, metadata=other, timeout=10)
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
        for message in stream:  # the other key's cancel did not reach it: it runs to its length
            received += message.token_ids
            if message.finish_reason:
                assert message.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert len(received) == max_tokens
        for _ in range(100):  # the record catches up a few ms after the stream ends
            status = stub.GetRequestStatus(generation_pb2.GetRequestStatusRequest(request_id=request_id),
                                           metadata=guarded.metadata, timeout=10)
            if status.status == generation_pb2.REQUEST_STATUS_FINISHED:
                break
            time.sleep(0.05)
        assert status.status == generation_pb2.REQUEST_STATUS_FINISHED and status.num_output_tokens == max_tokens
        resumed = list(stub.GenerateStream(generation_pb2.GenerateRequest(
            prompt="hi", request_id=request_id, resume_from_index=max_tokens - 5), metadata=guarded.metadata, timeout=30))
        assert sum(len(m.token_ids) for m in resumed) == 5


def test_a_keys_latency_targets_reach_the_scheduler_request(guarded):
    """The keys file's target_itl_ms / target_ttft_ms ride on every request of that key to the
    scheduler's own Request: read back from what the scheduler stores for re-admission (its Request as
    a SubmitRequest in Redis, tokenmill:live:*) while each request runs. A key without targets sends none."""
    import base64

    import redis

    from kvstore.live_requests import LIVE_KEY_PREFIX
    from protos.tokenmill.v1 import scheduler_pb2
    from tests.e2e.guarded.conftest import CLASS_ITL_MS, CLASS_KEY, CLASS_TTFT_MS

    store = redis.Redis.from_url(guarded.config.effective_redis_url)

    def submitted(request_id: str) -> scheduler_pb2.SubmitRequest:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for key in store.scan_iter(match=LIVE_KEY_PREFIX + "*"):
                entry = store.hget(key, request_id)
                if entry is not None:
                    return scheduler_pb2.SubmitRequest.FromString(base64.b64decode(entry))
            time.sleep(0.05)
        raise AssertionError(f"{request_id}: no live submission in Redis")

    long_request = generation_pb2.GenerateRequest(prompt="hi", parameters=generation_pb2.GenerateParameters(
        max_tokens=400, ignore_eos=True))
    with grpc.insecure_channel(guarded.config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for key, expected in ((CLASS_KEY, (CLASS_ITL_MS, CLASS_TTFT_MS)), (MAIN_KEY, None)):
            stream = stub.GenerateStream(long_request, metadata=(("authorization", f"Bearer {key}"),), timeout=60)
            try:
                request_id = next(stream).request_id  # running now
                message = submitted(request_id)
            finally:
                stream.cancel()
            if expected is None:
                assert not message.HasField("target_itl_ms") and not message.HasField("target_ttft_ms")
                assert message.owner == "main"
            else:
                assert (message.target_itl_ms, message.target_ttft_ms) == expected and message.owner == "class"
