"""Constrained decoding on every public API of a real cluster (tests/gateway/conftest.py, the default
model): tokenmill.v1 GenerateParameters.constraint over gRPC, OpenAI response_format and vLLM's guided_*
fields over HTTP (the unmodified openai client, chat.completions.parse with a pydantic model included),
KServe sampling_parameters through tritonclient; a malformed schema, regex or grammar is
INVALID_ARGUMENT / 400 naming the field and the problem. Plus the codec round trip of every kind."""
from __future__ import annotations

import json
import re

import grpc
import jsonschema
import numpy as np
import openai
import pydantic
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from core.sampling import ConstraintKind, OutputConstraint, SamplingParams
from protos.codec import sampling_params_from_proto, sampling_params_to_proto
from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                           "population": {"type": "integer", "minimum": 0}},
          "required": ["city", "population"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Give a city and its population as JSON."}]


@pytest.mark.parametrize("constraint", [
    OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA)), OutputConstraint(ConstraintKind.JSON_OBJECT),
    OutputConstraint(ConstraintKind.REGEX, "[a-z]+"), OutputConstraint(ConstraintKind.CHOICE, choices=("a", "b")),
    OutputConstraint(ConstraintKind.GRAMMAR, 'root ::= "x"'), None])
def test_codec_round_trips_every_kind(constraint):
    params = SamplingParams(temperature=0.0, constraint=constraint, logit_bias=((3, -100.0), (70, 2.5)))
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params


def _generate(config, text: str, **parameters) -> generation_pb2.GenerateResponse:
    request = generation_pb2.GenerateRequest(
        messages=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content=text)]),
        parameters=generation_pb2.GenerateParameters(**parameters))
    with grpc.insecure_channel(config.gateway_address) as channel:
        return generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300)


@pytest.mark.slow
def test_grpc_constraint_and_its_refusals(gateway_cluster):
    schema = sampling_pb2.OutputConstraint(json_schema=json.dumps(SCHEMA))
    response = _generate(gateway_cluster, CHAT[0]["content"], max_tokens=60, temperature=0.0, constraint=schema)
    jsonschema.validate(json.loads(response.text), SCHEMA)
    choice = sampling_pb2.OutputConstraint(choice=sampling_pb2.ChoiceList(choices=["red", "green"]))
    picked = _generate(gateway_cluster, "A colour?", max_tokens=8, temperature=1.0, seed=5, constraint=choice)
    assert picked.text in ("red", "green")
    for bad, words in [(sampling_pb2.OutputConstraint(regex="a(b"), ["regex", "unclosed group"]),
                       (sampling_pb2.OutputConstraint(json_schema='{"type": "strin"}'), ["json_schema", "strin"]),
                       (sampling_pb2.OutputConstraint(grammar="start: missing"), ["grammar", "missing"])]:
        with pytest.raises(grpc.RpcError) as caught:
            _generate(gateway_cluster, "Hi", max_tokens=4, constraint=bad)
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert all(word in caught.value.details() for word in words), caught.value.details()


class City(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)
    population: int = pydantic.Field(ge=0)


@pytest.mark.slow
def test_openai_response_format_and_guided_fields(client):
    model = client.models.list().data[0].id
    strict = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(strict.choices[0].message.content), SCHEMA)
    parsed = client.chat.completions.parse(model=model, messages=CHAT, max_tokens=60, temperature=0,
                                           response_format=City)
    assert isinstance(parsed.choices[0].message.parsed, City)
    any_object = client.chat.completions.create(model=model, messages=CHAT, max_tokens=60, temperature=0,
                                                response_format={"type": "json_object"})
    assert isinstance(json.loads(any_object.choices[0].message.content), dict)
    regex = client.completions.create(model=model, prompt="My phone number is", max_tokens=12, temperature=1.0,
                                      seed=1, extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", regex.choices[0].text)
    choice = client.chat.completions.create(model=model, messages=CHAT, max_tokens=5, temperature=0,
                                            extra_body={"guided_choice": ["Paris", "Rome"]}, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in choice if chunk.choices) in ("Paris", "Rome")


@pytest.mark.slow
def test_openai_malformed_constraints_are_400_naming_the_field(client):
    model = client.models.list().data[0].id
    cases = [({"extra_body": {"guided_regex": "a(b"}}, "guided_regex", "unclosed group"),
             ({"extra_body": {"guided_json": {"type": "strin"}}}, "guided_json", "strin"),
             ({"extra_body": {"guided_grammar": "root ::= ("}}, "guided_grammar", "GBNF"),
             ({"extra_body": {"guided_choice": []}}, "guided_choice", "at least one"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
              "response_format.json_schema.schema", "type"),
             ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex",
              "only one")]
    for extra, param, words in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, **extra)
        assert caught.value.param == param and words in caught.value.message, (extra, caught.value.message)


@pytest.mark.slow
def test_kserve_sampling_parameters_carry_a_constraint(gateway_cluster):
    client = grpcclient.InferenceServerClient(gateway_cluster.gateway_address)

    def inputs(sampling: dict) -> list:
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"The best colour is"], dtype=object))
        parameters = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
        parameters.set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=object))
        return [text, parameters]

    result = client.infer("smollm2", inputs({"max_tokens": 6, "temperature": 0, "guided_choice": ["blue", "teal"]}))
    assert result.as_numpy("text_output")[0].decode() in ("blue", "teal")
    with pytest.raises(InferenceServerException) as caught:
        client.infer("smollm2", inputs({"max_tokens": 6, "guided_regex": "a(b"}))
    assert caught.value.status() == "StatusCode.INVALID_ARGUMENT" and "guided_regex" in caught.value.message()


@pytest.mark.slow
def test_logit_bias_over_http_and_grpc(gateway_cluster, client):
    """+100 on one token makes it every greedy token; -100 on the unbiased greedy token bans it."""
    model = client.models.list().data[0].id
    prompt, equals = "The capital of France is", 45  # "="
    free = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0)
    forced = client.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0,
                                       logit_bias={str(equals): 100})
    assert forced.choices[0].text == "===" != free.choices[0].text

    def generate(stub, **parameters):
        request = generation_pb2.GenerateRequest(prompt=prompt, parameters=generation_pb2.GenerateParameters(
            max_tokens=1, temperature=0.0, **parameters))
        return list(stub.Generate(request, timeout=300).token_ids)

    with grpc.insecure_channel(gateway_cluster.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        assert generate(stub, logit_bias=[sampling_pb2.TokenBias(token_id=equals, bias=100.0)]) == [equals]
        [first] = generate(stub)
        assert generate(stub, logit_bias=[sampling_pb2.TokenBias(token_id=first, bias=-100.0)]) != [first]


@pytest.mark.slow
def test_completions_echo_puts_the_prompt_first(client):
    model = client.models.list().data[0].id
    prompt = "The capital of France is"
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0).choices[0].text
    echoed = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                         stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == prompt + plain
