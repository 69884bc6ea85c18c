"""Tool calling through a real cluster (tests/gateway/conftest.py, the default model, whose ChatML template
knows no tools: the gateway's Hermes prompt and parser) with the unmodified openai client: required and named
calls are constrained to the tools' schemas, whole and streamed alike; a round trip with the tool's result
gets an answer; chat.completions.parse reads a pydantic tool's arguments."""
from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

pytestmark = pytest.mark.slow

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                           "parameters": {"type": "object", "properties": {
                                               "zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _streamed_calls(chunks) -> tuple[str, list[dict], str]:
    """What a client rebuilds from the stream: content, calls ({id, name, arguments}), the finish reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.function.arguments == "" and call.type == "function"
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            else:
                calls[call.index]["arguments"] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[index] for index in sorted(calls)], finish


def test_required_and_named_calls_follow_the_schema_whole_and_streamed(client, model):
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        # one call: this small model, free to write another after the first, writes calls until max_tokens
        request = dict(model=model, messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=60,
                       temperature=0, parallel_tool_calls=False)
        whole = client.chat.completions.create(**request).choices[0]
        assert whole.finish_reason == "tool_calls", whole
        calls = whole.message.tool_calls
        assert len(calls) == 1 and whole.message.content is None
        for call in calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        if isinstance(choice, dict):
            assert [call.function.name for call in calls] == ["get_time"]
        content, streamed, finish = _streamed_calls(client.chat.completions.create(**request, stream=True))
        assert (content, finish) == ("", "tool_calls")
        assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments)
                                                                   for c in calls]


def test_a_round_trip_with_the_tool_result_gets_an_answer(client, model):
    first = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, max_tokens=60,
                                           temperature=0, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*QUESTION, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id,
                 "content": json.dumps({"temperature": 21, "sky": "sunny"})}]
    answer = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=40,
                                            temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    # the prompt held the call and its result: more tokens than the question and the tools alone
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 20


class GetWeather(pydantic.BaseModel):
    """Current weather in a city."""

    city: str = pydantic.Field(max_length=12)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")


def test_parse_reads_a_pydantic_tools_arguments(client, model):
    parsed = client.chat.completions.parse(model=model, messages=QUESTION, max_tokens=60, temperature=0,
                                           tools=[openai.pydantic_function_tool(GetWeather)],
                                           tool_choice="required", parallel_tool_calls=False)
    call = parsed.choices[0].message.tool_calls[0]
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)
