"""Every bad value a client can send, against the running cluster: the gRPC public API, the OpenAI
HTTP API and the scheduler's internal API. Each gets its status and a message naming the field, the
value and the limit; after the table the cluster still serves."""
from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import grpc
import pytest

from protos.tokenmill.v1 import generation_pb2 as g
from protos.tokenmill.v1 import generation_pb2_grpc, sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.guarded.conftest import MAIN_KEY, MAX_MODEL_LEN, assert_all_healthy

INVALID, NOT_FOUND, EXHAUSTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                                 grpc.StatusCode.RESOURCE_EXHAUSTED)


def req(prompt: str | None = "hi", messages: list[tuple[str, str]] | None = None, model: str = "",
        priority: int = 0, request_id: str = "", **params) -> g.GenerateRequest:
    request = g.GenerateRequest(model=model, priority=priority, request_id=request_id,
                                parameters=g.GenerateParameters(**{"max_tokens": 2, **params}))
    if messages is not None:
        request.messages.CopyFrom(g.ChatMessages(messages=[g.ChatMessage(role=r, content=c) for r, c in messages]))
    elif prompt is not None:
        request.prompt = prompt
    return request


# (id, request, status, substrings of the message: the field, the value, the limit)
GRPC_CASES = [
    ("empty prompt", req(""), INVALID, ["prompt=''", "must not be empty"]),
    ("no input", req(None), INVALID, ["prompt=''", "must not be empty"]),
    ("prompt longer than the context", req("x" * 600), INVALID,
     ["prompt_token_ids", f"at most {MAX_MODEL_LEN - 1} tokens", f"max_model_len={MAX_MODEL_LEN}", "got 60"]),
    ("prompt above max chars", req("x" * 500_001), INVALID, ["prompt=", "at most 500000 characters", "got 500001"]),
    ("max_tokens 0", req(max_tokens=0), INVALID, ["max_tokens=0", "[1, 4096]"]),
    ("max_tokens above the limit", req(max_tokens=4097), INVALID, ["max_tokens=4097", "[1, 4096]"]),
    ("max_tokens at uint32 max", req(max_tokens=2**32 - 1), INVALID, ["max_tokens=4294967295", "[1, 4096]"]),
    ("prompt + max_tokens past the context", req(max_tokens=600), INVALID,
     ["max_tokens=600", f"max_model_len={MAX_MODEL_LEN}"]),
    ("temperature negative", req(temperature=-0.5), INVALID, ["temperature=-0.5", "[0, 100]"]),
    ("temperature NaN", req(temperature=math.nan), INVALID, ["temperature=nan", "finite", "[0, 100]"]),
    ("temperature inf", req(temperature=math.inf), INVALID, ["temperature=inf", "[0, 100]"]),
    ("top_p 0", req(top_p=0.0), INVALID, ["top_p=0.0", "(0, 1]"]),
    ("top_p above 1", req(top_p=1.5), INVALID, ["top_p=1.5", "(0, 1]"]),
    ("top_p NaN", req(top_p=math.nan), INVALID, ["top_p=nan", "(0, 1]"]),
    ("top_k below -1", req(top_k=-2), INVALID, ["top_k=-2", ">= -1"]),
    ("min_p above 1", req(min_p=2.0), INVALID, ["min_p=2.0", "[0, 1]"]),
    ("repetition_penalty 0", req(repetition_penalty=0.0), INVALID, ["repetition_penalty=0.0", "(0, 100]"]),
    ("presence_penalty out of range", req(presence_penalty=3.0), INVALID, ["presence_penalty=3.0", "[-2, 2]"]),
    ("too many stop strings", req(stop=["s"] * 17), INVALID, ["stop=", "at most 16 strings", "got 17"]),
    ("stop string too long", req(stop=["ok", "y" * 257]), INVALID, ["stop[1]=", "at most 256 characters", "got 257"]),
    ("empty stop string", req(stop=[""]), INVALID, ["stop[0]=''", "must not be empty"]),
    ("stop token id outside the vocabulary", req(stop_token_ids=[5, 300]), INVALID,
     ["stop_token_ids[1]=300", "[0, 257]", "vocab_size=258"]),
    ("too many logprobs", req(logprobs=21), INVALID, ["logprobs=21", "[0, 20]"]),
    ("unknown model", req(model="gpt-17"), NOT_FOUND, ["model 'gpt-17' not found", "tiny-llama"]),
    # gRPC's own check names both sizes: "Received message larger than max (5242893 vs. 4194304)"
    ("message above the size limit", req("z" * (20 * 2**20)), EXHAUSTED, ["larger than max", " vs. "]),
    ("no chat messages", req(messages=[]), INVALID, ["messages=[]", "at least one message"]),
    ("chat message without role", req(messages=[("", "hello")]), INVALID, ["messages[0].role=''", "must not be empty"]),
    ("chat too many messages", req(messages=[("user", "x")] * 1025), INVALID, ["messages=", "at most 1024 messages"]),
    ("priority above the limit", req(priority=2_000_000), INVALID, ["priority=2000000", "[-1000000, 1000000]"]),
    ("priority below the limit", req(priority=-(2**31)), INVALID, ["priority=-2147483648", "[-1000000, 1000000]"]),
    ("request id too long", req(request_id="r" * 257), INVALID, ["request_id=", "at most 256 characters"]),
]


@pytest.fixture(scope="module")
def stub(guarded):
    with grpc.insecure_channel(guarded.config.gateway_address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@pytest.mark.parametrize(("request_", "code", "parts"), [c[1:] for c in GRPC_CASES], ids=[c[0] for c in GRPC_CASES])
def test_grpc_bad_input_gets_its_status_and_a_message_naming_field_value_and_limit(guarded, stub, request_, code,
                                                                                   parts):
    for call in (stub.Generate, lambda r, **kw: list(stub.GenerateStream(r, **kw))):
        with pytest.raises(grpc.RpcError) as caught:
            call(request_, metadata=guarded.metadata, timeout=30)
        assert caught.value.code() == code, caught.value.details()
        for part in parts:
            assert part in caught.value.details()


HTTP_CASES = [  # (id, path, raw JSON body, HTTP status, substrings)
    ("max_tokens negative", "completions", {"prompt": "hi", "max_tokens": -1}, 400, ["max_tokens=-1", "[1, 4096]"]),
    ("max_completion_tokens 0", "chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_completion_tokens": 0}, 400, ["max_completion_tokens=0"]),
    ("max_tokens not a number", "completions", {"prompt": "hi", "max_tokens": "ten"}, 400, ["max_tokens='ten'"]),
    ("temperature NaN", "completions", '{"prompt": "hi", "temperature": NaN}', 400, ["temperature=nan", "[0, 100]"]),
    ("top_p above 1", "completions", {"prompt": "hi", "top_p": 1.01}, 400, ["top_p=1.01", "(0, 1]"]),
    ("top_k below -1", "completions", {"prompt": "hi", "top_k": -5}, 400, ["top_k=-5", ">= -1"]),
    ("seed huge", "completions", {"prompt": "hi", "seed": 2**70}, 400, ["seed=", "must be in"]),
    ("empty prompt", "completions", {"prompt": ""}, 400, ["prompt=''", "must not be empty"]),
    ("token id outside the vocabulary", "completions", {"prompt": [1, 258]}, 400, ["prompt[1]=258", "[0, 257]"]),
    ("unknown model", "completions", {"prompt": "hi", "model": "gpt-17"}, 404, ["model 'gpt-17' not found"]),
    ("messages not a list", "chat/completions", {"messages": "hi"}, 400, ["messages='hi'", "must be a list"]),
    ("message without content", "chat/completions", {"messages": [{"role": "user"}]}, 400,
     ["messages[0].content", "is required"]),
    ("message content a number", "chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400,
     ["messages[0].content=5", "must be a string"]),
    ("stop too many", "completions", {"prompt": "hi", "stop": ["a"] * 17}, 400, ["at most 16 strings"]),
    ("priority not an integer", "completions", {"prompt": "hi", "priority": 1.5}, 400, ["priority=1.5"]),
    ("body not JSON", "completions", "{not json", 400, ["body=", "not valid JSON"]),
    ("body not an object", "completions", "[1, 2]", 400, ["body=[1, 2]", "must be a JSON object"]),
    ("body above the size limit", "completions", json.dumps({"prompt": "x" * (3 * 2**20)}), 413,
     ["Maximum request body size 3048576 exceeded"]),
]


def post(guarded, path: str, body: object, key: str | None = MAIN_KEY) -> tuple[int, dict, dict]:
    data = body if isinstance(body, str) else json.dumps(body)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"http://{guarded.config.http_address}/v1/{path}", data=data.encode(),
                                     headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), dict(error.headers)


@pytest.mark.parametrize(("path", "body", "status", "parts"), [c[1:] for c in HTTP_CASES],
                         ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input_gets_its_status_and_a_message_naming_field_value_and_limit(guarded, path, body, status,
                                                                                   parts):
    got, reply, _ = post(guarded, path, {**body, "max_tokens": body.get("max_tokens", 2)}
                         if isinstance(body, dict) and path == "completions" else body)
    assert got == status, reply
    for part in parts:
        assert part in reply["error"]["message"]


def submit(prompt_token_ids, **params) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id="internal", prompt_token_ids=prompt_token_ids,
                                       sampling_params=sampling_pb2.SamplingParams(**{"max_tokens": 2, **params}))


INTERNAL_CASES = [
    ("token id outside the vocabulary", submit([1, 2, 258]), ["prompt_token_ids[2]=258", "[0, 257]", "vocab_size=258"]),
    ("token id at uint32 max", submit([2**32 - 1]), ["prompt_token_ids[0]=4294967295", "[0, 257]"]),
    ("stop token id outside the vocabulary", submit([1], stop_token_ids=[999]), ["stop_token_ids[0]=999"]),
    ("empty prompt", submit([]), ["prompt_token_ids=[]", "at least one token"]),
    ("prompt longer than the context", submit([1] * MAX_MODEL_LEN), [f"at most {MAX_MODEL_LEN - 1} tokens"]),
    ("max_tokens 0", submit([1], max_tokens=0), ["max_tokens=0", ">= 1"]),
    ("temperature NaN", submit([1], temperature=math.nan), ["temperature=nan"]),
    ("top_p 0", submit([1], top_p=0.0), ["top_p=0.0", "(0, 1]"]),
    ("top_k below -1", submit([1], top_k=-7), ["top_k=-7"]),
    ("logprobs too many", submit([1], logprobs=10_000), ["logprobs=10000", "[0, 20]"]),
]


@pytest.mark.parametrize(("request_", "parts"), [c[1:] for c in INTERNAL_CASES], ids=[c[0] for c in INTERNAL_CASES])
def test_scheduler_internal_api_refuses_what_would_break_a_worker_step(guarded, request_, parts):
    with grpc.insecure_channel(guarded.config.scheduler_address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            list(scheduler_pb2_grpc.SchedulerStub(channel).Submit(request_, timeout=30))
    assert caught.value.code() == INVALID, caught.value.details()
    for part in parts:
        assert part in caught.value.details()


def test_after_the_table_the_cluster_still_serves(guarded, stub):
    reply = stub.Generate(req("hello there", max_tokens=3, ignore_eos=True), metadata=guarded.metadata, timeout=60)
    assert len(reply.token_ids) == 3 and reply.usage.completion_tokens == 3
    status, body, _ = post(guarded, "chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert_all_healthy(guarded)
