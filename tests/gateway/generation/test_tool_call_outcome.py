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
])
def test_the_outcome_names_the_calls_or_the_failure(syntax, text, names, result):
    seen = outcome(syntax, text)
    assert seen.names == names and seen.outcome == result
    assert seen.attributes()["tokenmill.tool_calls.outcome"] == result


def test_no_tools_no_outcome():
    assert _Deltas.tool_calls(SimpleNamespace(text=None, prepared=SimpleNamespace(tool_syntax=None))) is None
