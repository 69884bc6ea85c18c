"""Issue 31's hostile inputs, against the running cluster on all three APIs (native gRPC, OpenAI HTTP,
KServe through tritonclient): each is a 400 / INVALID_ARGUMENT naming the field and the limit, the
gateway process is the same one afterwards (no crash, no restart), and a normal request is still served.

- the 3,000-rule chained Lark grammar that segfaulted the gateway, and a 1,998-rule one under the rule
  limit that still overflows the compiler's stack (contained by the grammar sandbox's helper process);
- lone surrogates in a prompt, chat content, a tool description and a regex;
- a 500-deep JSON schema (gRPC json_schema, KServe guided_json), 100k nested "[" in KServe
  sampling_parameters;
- unsatisfiable schemas ($ref loops);
- a fuzzer over constraint texts: never a 5xx.
"""
from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from hypothesis import HealthCheck, given, settings, strategies as st
from tritonclient.utils import InferenceServerException

from protos.tokenmill.v1 import generation_pb2 as g
from protos.tokenmill.v1 import generation_pb2_grpc, sampling_pb2
from tests.e2e.guarded.conftest import MAIN_KEY, assert_all_healthy
from tests.e2e.guarded.test_bad_input import post, req

MODEL = "tiny-llama"


def chained(num_rules: int, body: str = '"x{i}" r{j}') -> str:
    """start -> r0 -> r1 -> ... : each rule one level deeper in the compiler's recursion."""
    rules = "".join(f"r{i}: " + body.format(i=i, j=i + 1) + "\n" for i in range(num_rules))
    return f"start: r0\n{rules}r{num_rules}: \"end\"\n"


OVER_THE_RULE_LIMIT = chained(3000)  # ~60 kB: SIGSEGV in the gateway before the sandbox
# under the rule limit, but each rule's groups deepen the recursion: crashes the helper, not the gateway
CRASHES_THE_COMPILER = chained(1998, '("x{i}" ((r{j})))')
DEEP_SCHEMA = '{"type": "object", "properties": {"a": ' * 250 + '{"type": "string"}' + "}}" * 250
SURROGATE = "\ud800"


@pytest.fixture(scope="module")
def stub(guarded):
    with grpc.insecure_channel(guarded.config.gateway_address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module", autouse=True)
def first_gateway_pid(guarded) -> int:
    return gateway_pid(guarded)


@pytest.fixture(scope="module")
def triton(guarded):
    return grpcclient.InferenceServerClient(guarded.config.gateway_address)


def gateway_pid(guarded) -> int:
    return guarded.supervisor.children["gateway"].pid


def grpc_refusal(guarded, stub, constraint: sampling_pb2.OutputConstraint) -> str:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(req("hi", constraint=constraint), metadata=guarded.metadata, timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    return caught.value.details()


def http_refusal(guarded, body: dict, path: str = "completions") -> dict:
    status, reply, _ = post(guarded, path, {"prompt": "hi", "max_tokens": 2, **body} if path == "completions"
                            else {"max_tokens": 2, **body})
    assert status == 400, reply
    return reply["error"]


def kserve_refusal(triton, sampling: dict | str) -> str:
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hi"], dtype=object))
    parameters = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    raw = sampling if isinstance(sampling, str) else json.dumps({"max_tokens": 2, **sampling})
    parameters.set_data_from_numpy(np.array([raw.encode()], dtype=object))
    with pytest.raises(InferenceServerException) as caught:
        triton.infer(MODEL, [text, parameters], headers={"authorization": f"Bearer {MAIN_KEY}"}, client_timeout=60)
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT", caught.value.message()
    return caught.value.message()


@pytest.mark.parametrize("grammar, words", [
    (OVER_THE_RULE_LIMIT, "at most 2000 rules (the grammar rule limit)"),
    (CRASHES_THE_COMPILER, "crashed the grammar compiler (SIGSEGV)"),
], ids=["3000-rule chain", "stack-deep under the rule limit"])
def test_a_grammar_that_crashed_the_gateway_is_a_400_on_every_api(guarded, stub, triton, grammar, words):
    pid = gateway_pid(guarded)
    assert words in grpc_refusal(guarded, stub, sampling_pb2.OutputConstraint(grammar=grammar))
    error = http_refusal(guarded, {"guided_grammar": grammar})
    assert error["param"] == "guided_grammar" and words in error["message"]
    message = kserve_refusal(triton, {"guided_grammar": grammar})
    assert "guided_grammar" in message and words in message
    assert gateway_pid(guarded) == pid  # the same process: nothing crashed or restarted
    reply = stub.Generate(req("hello", max_tokens=3, ignore_eos=True), metadata=guarded.metadata, timeout=60)
    assert len(reply.token_ids) == 3
    assert_all_healthy(guarded)


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"prompt": f"a{SURROGATE}b"}, "body.prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": SURROGATE}]}, "body.messages[0].content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "description": f"x{SURROGATE}"}}]},
     "body.tools[0].function.description"),
    ("completions", {"guided_regex": f"[a-z]{SURROGATE}"}, "body.guided_regex"),
], ids=["prompt", "chat content", "tool description", "guided_regex"])
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(guarded, path, body, param):
    error = http_refusal(guarded, body, path)
    assert error["param"] == param and "lone surrogate U+D800" in error["message"], error


def test_deep_nesting_in_json_bearing_strings_is_invalid_argument(guarded, stub, triton):
    details = grpc_refusal(guarded, stub, sampling_pb2.OutputConstraint(json_schema=DEEP_SCHEMA))
    assert "json_schema" in details and "the nesting limit" in details
    message = kserve_refusal(triton, {"guided_json": DEEP_SCHEMA})
    assert "guided_json" in message and "the nesting limit" in message
    message = kserve_refusal(triton, "[" * 100_000 + "]" * 100_000)
    assert "sampling_parameters" in message and "the nesting limit" in message
    assert_all_healthy(guarded)


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
], ids=["self", "mutual", "through a required property"])
def test_an_unsatisfiable_schema_is_a_400_not_an_empty_200(guarded, stub, schema):
    error = http_refusal(guarded, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "loop", "schema": schema}}})
    assert "unsatisfiable" in error["message"], error
    assert "unsatisfiable" in grpc_refusal(guarded, stub, sampling_pb2.OutputConstraint(json_schema=json.dumps(schema)))


_CONSTRAINT_TEXT = st.lists(st.sampled_from([*'()[]{}|*+?:"\'\\/ ab.=\n-', "::=", "start", "root", SURROGATE,
                                             "%json", "{\"type\": ", '"$ref": "#"']), max_size=40).map("".join)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(["guided_grammar", "guided_regex", "guided_json"]), text=_CONSTRAINT_TEXT)
def test_fuzzed_constraints_never_get_a_server_error(guarded, field, text):
    status, reply, _ = post(guarded, "completions", {"prompt": "hi", "max_tokens": 2, field: text})
    assert status in (200, 400), (status, reply)


def test_after_the_hostile_constraints_the_gateway_is_the_same_process_and_serves(guarded, stub, first_gateway_pid):
    reply = stub.Generate(req("hello there", max_tokens=3, ignore_eos=True), metadata=guarded.metadata, timeout=60)
    assert len(reply.token_ids) == 3
    assert gateway_pid(guarded) == first_gateway_pid
    assert_all_healthy(guarded)
