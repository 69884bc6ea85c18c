"""Property-based fuzzing of the public APIs of a running cluster: random fields (junk strings,
extremes, NaN and infinities, the largest integers each wire type holds). Whatever comes in, every call
ends within its deadline with OK or a status a client can act on; afterwards every process is healthy.

Fast on purpose: max_tokens is small or invalid, prompts are short, so most requests are refused at
the edge and the rest generate a few tokens of a tiny model.
"""
from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.tokenmill.v1 import generation_pb2 as g
from protos.tokenmill.v1 import generation_pb2_grpc
from tests.e2e.guarded.conftest import MAIN_KEY, assert_all_healthy

CALL_DEADLINE_S = 30.0  # per call; a call that needs it has hung (a valid one takes milliseconds)
CLIENT_FAULTS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))

UINT32, INT32, UINT64 = 2**32 - 1, 2**31 - 1, 2**64 - 1
# Strategies are built once, here: building them inside a composite per example costs more than the calls.
junk_text = st.one_of(st.text(max_size=40), st.text(alphabet=st.characters(codec="utf-8"), max_size=8),
                      st.sampled_from(["", " ", "\x00", "\ud7ff\ufffd", "<s>", "</s>", "{{ 7*7 }}", "%s%n", "x" * 300]))
any_float = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1.0, 1e-300]))
small_or_extreme = st.one_of(st.integers(0, 3), st.sampled_from([4097, INT32, UINT32]))
int32 = st.one_of(st.integers(-3, 3), st.integers(-(INT32 + 1), INT32))

junk_parameters = st.fixed_dictionaries(
    {"max_tokens": small_or_extreme,  # never unset: the default (256 tokens) is not "tiny"
     "stop": st.one_of(st.lists(junk_text, max_size=3), st.just(["s"] * 17)),
     "stop_token_ids": st.lists(st.one_of(st.integers(0, 300), st.just(UINT32)), max_size=4),
     "ignore_eos": st.booleans()},
    optional={"temperature": any_float, "top_p": any_float, "min_p": any_float, "repetition_penalty": any_float,
              "presence_penalty": any_float, "frequency_penalty": any_float, "top_k": int32,
              "seed": st.integers(0, UINT64), "logprobs": st.one_of(st.integers(0, 25), st.just(UINT32))},
).map(lambda fields: g.GenerateParameters(**fields))
plausible_parameters = st.fixed_dictionaries(
    {"max_tokens": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
     "top_k": st.integers(-1, 50), "min_p": st.floats(0, 0.5), "seed": st.integers(0, UINT64),
     "repetition_penalty": st.floats(0.5, 2), "stop": st.lists(st.text(min_size=1, max_size=5), max_size=3),
     "stop_token_ids": st.lists(st.integers(0, 257), max_size=3), "ignore_eos": st.booleans()},
    optional={"logprobs": st.integers(0, 5)},
).map(lambda fields: g.GenerateParameters(**fields))
chat_turns = st.lists(st.tuples(st.one_of(st.sampled_from(["user", "system", "assistant"]), junk_text), junk_text),
                      max_size=3)
inputs = st.one_of(st.tuples(st.just("prompt"), junk_text), st.tuples(st.just("messages"), chat_turns),
                   st.just(("none", None)))
plausible_inputs = st.one_of(st.tuples(st.just("prompt"), st.text(min_size=1, max_size=30)),
                             st.tuples(st.just("messages"), st.lists(st.tuples(st.just("user"), st.text(max_size=30)),
                                                                     min_size=1, max_size=1)))
JUNKABLE = ("temperature", "top_p", "top_k", "max_tokens", "logprobs", "min_p", "stop_token_ids")


def build_request(model: str, request_id: str, priority: int, parameters: g.GenerateParameters,
                  input_: tuple[str, object]) -> g.GenerateRequest:
    request = g.GenerateRequest(model=model, request_id=request_id, priority=priority, parameters=parameters)
    kind, value = input_
    if kind == "prompt":
        request.prompt = value
    elif kind == "messages":
        request.messages.CopyFrom(g.ChatMessages(messages=[g.ChatMessage(role=r, content=c) for r, c in value]))
    return request


junk_requests = st.builds(build_request, model=st.one_of(st.just(""), st.just(""), st.just("tiny-llama"), junk_text),
                          request_id=st.one_of(st.just(""), junk_text), priority=int32, parameters=junk_parameters,
                          input_=inputs)


def spoil(request: g.GenerateRequest, junk: g.GenerateParameters, field: str | None) -> g.GenerateRequest:
    """request with one parameter taken from junk (None: left in range)."""
    if field is not None:
        request.parameters.ClearField(field)
        request.parameters.MergeFrom(g.GenerateParameters(**{field: getattr(junk, field)}))
    return request


# In range everywhere (so these run all the way through the worker), a third with one field gone wrong.
plausible_requests = st.builds(
    spoil, st.builds(build_request, model=st.just(""), request_id=st.just(""), priority=st.integers(-10, 10),
                     parameters=plausible_parameters, input_=plausible_inputs),
    junk_parameters, st.one_of(st.none(), st.none(), st.sampled_from(JUNKABLE)))


def test_fuzz_1000_grpc_requests_no_crash_no_hang(guarded):
    outcomes: dict[str, int] = {}
    with grpc.insecure_channel(guarded.config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)

        @settings(FUZZ, max_examples=1000)
        @given(request=st.one_of(junk_requests, junk_requests, plausible_requests), stream=st.booleans())
        def one(request, stream):
            try:
                if stream:
                    messages = list(stub.GenerateStream(request, metadata=guarded.metadata, timeout=CALL_DEADLINE_S))
                    assert messages and messages[-1].finish_reason, messages
                else:
                    reply = stub.Generate(request, metadata=guarded.metadata, timeout=CALL_DEADLINE_S)
                    assert reply.finish_reason and len(reply.token_ids) <= request.parameters.max_tokens
                outcome = "OK"
            except grpc.RpcError as error:
                assert error.code() in CLIENT_FAULTS, (error.code(), error.details(), request)
                assert error.details(), request
                outcome = error.code().name
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        one()
    assert sum(outcomes.values()) >= 1000, outcomes
    assert outcomes.get("OK", 0) >= 20 and outcomes.get("INVALID_ARGUMENT", 0) >= 150, outcomes  # both paths ran
    assert_all_healthy(guarded)


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), any_float, junk_text),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(junk_text, inner, max_size=3)), max_leaves=6)
HTTP_FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
               "stop", "stop_token_ids", "logprobs", "top_logprobs", "n", "stream", "model", "priority", "ignore_eos"]


@st.composite
def http_bodies(draw) -> tuple[str, dict]:
    path = draw(st.sampled_from(["completions", "chat/completions"]))
    body = {name: draw(json_values) for name in draw(st.lists(st.sampled_from(HTTP_FIELDS), unique=True, max_size=6))}
    if draw(st.booleans()):  # a plausible request with one or two fields gone wrong
        body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], **body}
    body["max_tokens"] = draw(st.one_of(small_or_extreme, json_values)) if draw(st.booleans()) else 2
    body.pop("max_completion_tokens", None)
    return path, body


def test_fuzz_http_bodies_never_answer_a_server_error(guarded):
    statuses: dict[int, int] = {}

    @settings(FUZZ, max_examples=200)
    @given(case=http_bodies())
    def one(case):
        path, body = case
        request = urllib.request.Request(
            f"http://{guarded.config.http_address}/v1/{path}", method="POST",
            data=json.dumps(body, allow_nan=True).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {MAIN_KEY}"})
        try:
            with urllib.request.urlopen(request, timeout=CALL_DEADLINE_S) as response:
                status = response.status
                response.read()
        except urllib.error.HTTPError as error:
            status = error.code
            assert json.loads(error.read())["error"]["message"]
        assert status in (200, 400, 404, 413, 429), (status, body)
        statuses[status] = statuses.get(status, 0) + 1

    one()
    assert sum(statuses.values()) >= 200 and statuses.get(400, 0) > 0, statuses
    assert_all_healthy(guarded)
