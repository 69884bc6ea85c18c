"""Tool-call parsers (gateway.text.tool_parsers): Hermes <tool_call> JSON and Llama 3 JSON, whole and streamed.
Every case is also fed a character at a time and in chunks: the deltas add up to the whole parse."""
from __future__ import annotations

import json

import pytest

from gateway.text.tool_parsers import (
    HermesCallStream,
    Llama3JsonCallStream,
    collect,
    parse_tool_calls,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, {"x": "}]"}]}}'

HERMES_CASES = [
    # text, content, [(name, arguments)]
    (f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", '{"city": "Paris", "days": [1, {"x": "}]"}]}')]),
    ((f'Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{{"name": "now", "arguments": {{}}}}\n'
      "</tool_call>\nDone."), "Let me look.\n\n\nDone.",
     [("get_weather", '{"city": "Paris", "days": [1, {"x": "}]"}]}'), ("now", "{}")]),
    # the end tag inside an argument string does not end the call; arguments before name; no arguments key
    ('<tool_call>{"arguments": {"html": "</tool_call>"}, "name": "show"}</tool_call> ok', "ok",
     [("show", '{"html": "</tool_call>"}')]),
    ('<tool_call>{"name": "ping"}</tool_call>', None, [("ping", "{}")]),
    # a model that leaves out the end tag, or is cut before it
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', None, [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}} and then', "and then", [("f", '{"a": 1}')]),
    # not calls: left in the content verbatim
    ("hi <tool_call>not json</tool_call> bye", "hi <tool_call>not json</tool_call> bye", []),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', '<tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "a=1"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "a=1"}</tool_call>', []),
    ('<tool_call>{"name": "f", "argu', '<tool_call>{"name": "f", "argu', []),
    ("  plain answer, a < b and <tool_ca  ", "plain answer, a < b and <tool_ca", []),
    ("", None, []),
]

LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": [2]}}', None,
     [("f", '{"a": 1}'), ("g", '{"b": [2]}')]),
    ('\n{"name": "f", "parameters": {}}\nThat is all.', "That is all.", [("f", "{}")]),
    # Llama's calls open the output: text first means an answer, not a call
    ('Sure: {"name": "f", "parameters": {}}', 'Sure: {"name": "f", "parameters": {}}', []),
    ('{"name": "f", "parameters": [1]}', '{"name": "f", "parameters": [1]}', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ("The answer is 4.", "The answer is 4.", []),
]


def _streamed(stream_class, text: str, step: int):
    stream = stream_class()
    events = []
    for start in range(0, len(text), step):
        events += stream.feed(text[start:start + step])
    return collect(events + stream.finish())


def _check(stream_class, text, content, calls):
    whole = parse_tool_calls(stream_class, text)
    assert (whole.content, [(call.name, call.arguments) for call in whole.tool_calls]) == (content, calls)
    assert all(call.id.startswith("call_") for call in whole.tool_calls)
    assert len({call.id for call in whole.tool_calls}) == len(calls)
    for call in whole.tool_calls:
        assert isinstance(json.loads(call.arguments), dict)
    for step in (1, 2, 7, len(text) or 1):
        streamed = _streamed(stream_class, text, step)
        assert (streamed.content, [(call.name, call.arguments) for call in streamed.tool_calls]) == (content, calls)


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_whole_and_streamed(text, content, calls):
    _check(HermesCallStream, text, content, calls)


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_json_whole_and_streamed(text, content, calls):
    _check(Llama3JsonCallStream, text, content, calls)


def test_a_stream_sends_the_name_first_then_the_arguments_as_they_come():
    stream = HermesCallStream()
    text = f"Checking.\n<tool_call>\n{WEATHER}\n</tool_call>"
    pieces = [stream.feed(char) for char in text] + [stream.finish()]
    events = [event for piece in pieces for event in piece]
    assert "".join(event for event in events if isinstance(event, str)) == "Checking."
    calls = [event for event in events if not isinstance(event, str)]
    assert calls[0].name == "get_weather" and calls[0].id.startswith("call_") and calls[0].arguments == ""
    assert all(call.name is None and call.id is None and call.index == 0 for call in calls[1:])
    assert len(calls) > 10  # the arguments arrive piece by piece, not at the end
    assert "".join(call.arguments for call in calls) == '{"city": "Paris", "days": [1, {"x": "}]"}]}'
    # nothing of the markup reaches the content, even while a tag is half written
    assert not any("<" in event for event in events if isinstance(event, str))


def test_a_call_broken_after_its_name_was_streamed_ends_as_sent():
    """The one place stream and whole differ (the module's docstring): a sent name cannot be taken back."""
    text = '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call> after'
    assert parse_tool_calls(HermesCallStream, text).tool_calls == []
    streamed = _streamed(HermesCallStream, text, 1)
    assert [call.name for call in streamed.tool_calls] == ["f"] and streamed.content == "after"
