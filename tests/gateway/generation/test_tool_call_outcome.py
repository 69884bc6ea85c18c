"""A tools chat's output parsed at its end for the request's telemetry (issue 38 item 4): the called
names, a call that began and did not parse (failed), or no call."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from gateway.generation.stream import _Deltas
from gateway.text.tool_syntax import HermesSyntax, Llama3JsonSyntax


def outcome(syntax, text: str):
    deltas = SimpleNamespace(text=[text[:5], text[5:]], prepared=SimpleNamespace(tool_syntax=syntax))
    return _Deltas.tool_calls(deltas)


@pytest.mark.parametrize("syntax, text, names, result", [
    (HermesSyntax(), '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     ["weather"], "parsed"),
    (HermesSyntax(), 'It is sunny.', [], "none"),
    (HermesSyntax(), '<tool_call>\n{"name": "weather", "argu', [], "failed"),
    (Llama3JsonSyntax(), '<|python_tag|>{"name": "time", "parameters": {}}', ["time"], "parsed"),
    (Llama3JsonSyntax(), '{"name": "time", "parameters": {}}', ["time"], "parsed"),
    (Llama3JsonSyntax(), '<|python_tag|>{"name": "time", "param', [], "failed"),
    # Llama 3.1's bare call (no python tag) that breaks off is a failed call too, not an answer
    (Llama3JsonSyntax(), '{"name": "time", "parameters": {"zone": ', [], "failed"),
    (Llama3JsonSyntax(), '  {"name": "time" "parameters"}', [], "failed"),
    (Llama3JsonSyntax(), 'It is noon.', [], "none"),
    (Llama3JsonSyntax(), 'The answer is {"name": 1}', [], "none"),
])
def test_the_outcome_names_the_calls_or_the_failure(syntax, text, names, result):
    seen = outcome(syntax, text)
    assert seen.names == names and seen.outcome == result
    assert seen.attributes()["tokenmill.tool_calls.outcome"] == result


def test_no_tools_no_outcome():
    assert _Deltas.tool_calls(SimpleNamespace(text=None, prepared=SimpleNamespace(tool_syntax=None))) is None


def test_a_call_split_by_a_scheduler_restart_is_still_seen_at_the_end():
    """The part streamed before the break and the part followed from Redis after it are parsed as one
    text, so a tools chat resumed through a scheduler restart ends as tool_calls, as an unbroken one does."""
    from gateway.generation.resume import _ToolText
    from gateway.generation.stream import GenerationDelta

    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    before_break = [call[:20]]
    tool_text = _ToolText(SimpleNamespace(tool_syntax=HermesSyntax()), before_break)
    assert tool_text.seen(GenerationDelta("r", call[20:40], [1], [])) is None  # not finished yet
    last = GenerationDelta("r", call[40:], [2], [], finish=SimpleNamespace())
    assert tool_text.seen(last).names == ["weather"]
