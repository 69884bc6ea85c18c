"""OpenAI tool calling on the chat API: tools / tool_choice / parallel_tool_calls -> the prompt and the output.

    tools = parse_tools(body)                       # ToolRequest, or None (no tools); 400s name the field
    messages, template_kwargs = tool_chat(messages, tools, tool_format, special_tokens)
    constraint = tool_constraint(tools, tool_format.syntax, constraint)   # required / named: constrained

tool_choice:
  auto (the default with tools)  unconstrained; the output is parsed (gateway.text.tool_parsers) for calls
  none                           as vLLM: the tools are still rendered, the output is not parsed (the
                                 model is told not to call by the request, not by its prompt)
  required                       constrained to one or more calls (one when parallel_tool_calls is false)
                                 to any of the tools, arguments valid against that tool's parameters
  {"type": "function", ...}      constrained to exactly one call to that function
Rendering (gateway.text.tool_syntax.ToolFormat): a template that renders tools gets `tools=` as transformers
passes it, and the assistant turns' calls with their arguments as objects (what templates `tojson`);
otherwise the tools go into a system message and calls and results into the turns' text.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from core.errors import InvalidArgument
from core.sampling import ConstraintKind, OutputConstraint
from gateway.text.chat_template import validate_messages
from gateway.text.tool_syntax import ToolFormat, ToolSyntax
from plumbing.constraint_limits import check_size

MAX_TOOLS = 128  # OpenAI's limit
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICE_SHAPE = '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: list[dict]  # as the client sent them, checked: [{"type": "function", "function": {"name", ...}}]
    choice: str  # "auto", "none", "required", or "function" (tool_choice names one)
    named: str | None  # the function tool_choice names
    parallel: bool  # parallel_tool_calls (default true)

    @property
    def parses_output(self) -> bool:
        return self.choice != "none"


def parse_tools(body: dict) -> ToolRequest | None:
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidArgument("parallel_tool_calls", parallel, "must be true or false")
    if not tools:
        if choice not in (None, "auto", "none"):
            raise InvalidArgument("tool_choice", choice, "needs tools: list the functions the model may call")
        return None
    if not isinstance(tools, list):
        raise InvalidArgument("tools", tools, 'must be a list of {"type": "function", "function": {...}}')
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument("tools", f"<{len(tools)} tools>", f"must hold at most {MAX_TOOLS} tools")
    names = [_check_tool(tool, f"tools[{index}]") for index, tool in enumerate(tools)]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise InvalidArgument(f"tools[{index}].function.name", name, "names a function listed before it")
    named = _named_choice(choice, names)
    kind = "function" if named else (choice or "auto")
    return ToolRequest(tools, kind, named, True if parallel is None else parallel)


def _check_tool(tool: object, field: str) -> str:
    if not isinstance(tool, dict):
        raise InvalidArgument(field, tool, 'must be an object like {"type": "function", "function": {...}}')
    if tool.get("type") != "function":
        raise InvalidArgument(f"{field}.type", tool.get("type"), 'must be "function"')
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidArgument(f"{field}.function", function, 'must be an object like {"name": ..., "parameters": {...}}')
    name = function.get("name")
    if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
        raise InvalidArgument(f"{field}.function.name", name,
                              "must be 1 to 64 letters, digits, underscores or dashes")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidArgument(f"{field}.function.description", description, "must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidArgument(f"{field}.function.parameters", parameters, "must be a JSON schema object")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidArgument(f"{field}.function.strict", strict, "must be true or false")
    return name


def _named_choice(choice: object, names: list[str]) -> str | None:
    if choice is None or choice in ("auto", "none", "required"):
        return None
    if not isinstance(choice, dict):
        raise InvalidArgument("tool_choice", choice, f"must be {_CHOICE_SHAPE}")
    if choice.get("type") != "function":
        raise InvalidArgument("tool_choice.type", choice.get("type"), 'must be "function"')
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidArgument("tool_choice.function.name", name, "is required: the name of one of the tools")
    if name not in names:
        raise InvalidArgument("tool_choice.function.name", name, f"names no function in tools ({', '.join(names)})")
    return name


def tool_constraint(tools: ToolRequest | None, syntax: ToolSyntax, constraint: OutputConstraint | None
                    ) -> tuple[OutputConstraint | None, list[tuple[OutputConstraint, str]]]:
    """constraint: the request's own (response_format, guided_*); required / named replace it, so the two
    together are a 400. Also each enforced tool's parameters schema with its field, for the grammar
    sandbox to compile first (a schema that does not compile is named by its own field)."""
    if tools is None or tools.choice in ("auto", "none"):
        return constraint, []
    shown = {"type": "function", "function": {"name": tools.named}} if tools.named else tools.choice
    if constraint is not None:
        raise InvalidArgument("tool_choice", shown, "is enforced with constrained decoding and cannot be combined "
                              "with response_format or guided_* in one request")
    functions, schemas = [], []
    for index, tool in enumerate(tools.tools):
        function = tool["function"]
        if tools.named not in (None, function["name"]):
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        schema = OutputConstraint(ConstraintKind.JSON_SCHEMA, json.dumps(parameters))
        check_size(schema, f"tools[{index}].function.parameters")
        schemas.append((schema, f"tools[{index}].function.parameters"))
        functions.append((function["name"], parameters))
    grammar = OutputConstraint(ConstraintKind.GRAMMAR, syntax.grammar(functions, tools.parallel and not tools.named))
    check_size(grammar, "tools")
    return grammar, schemas


def tool_chat(messages: object, tools: ToolRequest | None, tool_format: ToolFormat,
              special_tokens: tuple[str, ...]) -> tuple[object, dict]:
    """messages (text-only turns, assistant tool_calls and tool results kept) -> (the turns to render,
    the template's extra variables)."""
    calling = isinstance(messages, list) and any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in messages)
    if tools is None and not calling:
        return messages, {}
    validate_messages(messages)  # before turns merge or move, so a bad one is named by the client's index
    calls = {index: _calls(message, index) for index, message in enumerate(messages) if message.get("tool_calls")}
    if tool_format.native:
        for index, turn_calls in calls.items():
            messages[index] = {**messages[index], "tool_calls": [
                {**call, "function": {"name": name, "arguments": arguments}}
                for call, (name, arguments) in zip(messages[index]["tool_calls"], turn_calls)]}
        _refuse_special_tokens(tools, messages, special_tokens)
        return messages, ({"tools": tools.tools} if tools else {})
    return _fallback_chat(messages, calls, tools, tool_format.syntax), {}


def _calls(message: dict, index: int) -> list[tuple[str, dict]]:
    """An assistant turn's tool_calls -> [(name, arguments as an object)]."""
    field = f"messages[{index}].tool_calls"
    if message.get("role") != "assistant":
        raise InvalidArgument(field, "...", "only assistant messages carry tool calls")
    if not isinstance(message["tool_calls"], list):
        raise InvalidArgument(field, message["tool_calls"], 'must be a list of {"type": "function", "function": {...}}')
    calls = []
    for position, call in enumerate(message["tool_calls"]):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidArgument(f"{field}[{position}].function", function, 'must be {"name": ..., "arguments": ...}')
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError as error:
            raise InvalidArgument(f"{field}[{position}].function.arguments", arguments,
                                  f"must be a JSON object's text ({error})") from None
        if not isinstance(arguments, dict):
            raise InvalidArgument(f"{field}[{position}].function.arguments", arguments, "must be a JSON object")
        calls.append((function["name"], arguments))
    return calls


def _refuse_special_tokens(tools: ToolRequest | None, messages: list[dict], special_tokens: tuple[str, ...]) -> None:
    """The template writes tools and calls as its own text, where a special token's string would become the
    token itself (gateway.prepare.chat_encoding keeps only content as plain text): refuse those instead."""
    fields = [(f"tools[{index}]", tool) for index, tool in enumerate(tools.tools if tools else [])]
    fields += [(f"messages[{index}].tool_calls", m["tool_calls"]) for index, m in enumerate(messages)
               if m.get("tool_calls")]
    for field, value in fields:
        text = json.dumps(value, ensure_ascii=False)
        token = next((special for special in special_tokens if special in text), None)
        if token is not None:
            raise InvalidArgument(field, "...", f"holds the special token {token!r}; remove it")


def _fallback_chat(messages: list[dict], calls: dict[int, list], tools: ToolRequest | None,
                   syntax: ToolSyntax) -> list[dict]:
    """For a template that does not render tools: the tools in a system message (the client's first one, or a
    new one), earlier calls as the assistant's text, runs of tool results as one user turn."""
    out: list[dict] = []
    for index, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if index in calls:
            text = syntax.calls_text(calls[index])
            out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        elif role == "tool":
            if index and messages[index - 1]["role"] == "tool":
                out[-1]["results"].append(content)
            else:
                out.append({"role": "user", "results": [content]})
        else:
            out.append({"role": role, "content": content})
    for turn in out:
        if "results" in turn:
            turn["content"] = syntax.results_text(turn.pop("results"))
    if tools is not None:
        prompt = syntax.system_prompt(tools.tools)
        if out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# -- the output: content and tool_calls ------------------------------------------------------------------


def tool_message(syntax: ToolSyntax, text: str) -> dict:
    """A whole choice's text -> its message: {"role", "content" (None when only calls), "tool_calls"?}."""
    parsed = syntax.parse(text)
    message: dict = {"role": "assistant", "content": parsed.content}
    if parsed.tool_calls:
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}}
                                 for call in parsed.tool_calls]
    return message


class ToolCallDeltas:
    """One streamed choice's text -> chat deltas as OpenAI streams them: {"content": ...} for the text outside
    calls; a call's first delta {"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]},
    then {"tool_calls": [{"index", "function": {"arguments": <piece>}}]}. No markup leaks into content."""

    def __init__(self, syntax: ToolSyntax) -> None:
        self._stream = syntax.stream()
        self.called = False  # a call was sent: the choice finishes with "tool_calls"

    def deltas(self, text: str, last: bool) -> list[dict]:
        events = self._stream.feed(text) + (self._stream.finish() if last else [])
        out: list[dict] = []
        for event in events:
            previous = out[-1] if out else {}
            if isinstance(event, str):
                if "content" in previous:
                    previous["content"] += event
                else:
                    out.append({"content": event})
            elif event.name is not None:
                self.called = True
                out.append({"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                            "function": {"name": event.name, "arguments": ""}}]})
            elif "tool_calls" in previous and "id" not in previous["tool_calls"][0] \
                    and previous["tool_calls"][0]["index"] == event.index:
                previous["tool_calls"][0]["function"]["arguments"] += event.arguments
            else:
                out.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})
        return out
