"""How a model writes tool calls: one ToolSyntax per syntax, and the choice of one for a model.

    syntax = choose_tool_syntax("auto", tokenizer.chat_template)   # --tool-call-parser
    syntax.stream() / syntax.parse(text)              # its output -> calls (gateway.text.tool_parsers)
    syntax.grammar([(name, parameters), ...], parallel)  # an output that is exactly its call syntax
    syntax.system_prompt(tools), calls_text(...), results_text(...)   # a template without tools

Names as vLLM's --tool-call-parser: "hermes" (Qwen2.5, Hermes) and "llama3_json" (Llama 3.1+).
`auto` reads the chat template: one that writes <|python_tag|> or Llama's ipython turn is llama3_json,
anything else hermes. `native` is whether the template renders tools itself (it reads a `tools`
variable and writes this syntax); otherwise the gateway puts the tools and the instructions in a system
message in this syntax's own words (Qwen2.5's for hermes, Llama 3.1's for llama3_json), writes earlier
calls and tool results as text, and the model is asked for the syntax the parser reads.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from gateway.text.chat_template import template_variables
from gateway.text.tool_parsers import (
    HermesCallStream,
    Llama3JsonCallStream,
    ParsedOutput,
    parse_tool_calls,
)
from gateway.text.tool_syntax_names import TOOL_CALL_PARSERS

# Calls written as the models' own templates write them (tojson's ", " and ": "), so a constrained
# call reads like the calls the model was trained on.
_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ToolSyntax:
    name = ""
    arguments_key = "arguments"
    stream_class: type = HermesCallStream
    template_markers: tuple[str, ...] = ()  # text in a chat template that writes this syntax

    def stream(self):
        return self.stream_class()

    def parse(self, text: str) -> ParsedOutput:
        return parse_tool_calls(self.stream_class, text)

    def writes_this(self, chat_template: str) -> bool:
        return any(marker in chat_template for marker in self.template_markers)

    def call_failed(self, parsed: ParsedOutput) -> bool:
        """A call began and did not parse: the parser gave the text back as content with a call's start in it.
        parsed: this syntax's parse of a whole output."""
        return not parsed.tool_calls and any(marker in (parsed.content or "") for marker in self._call_starts())

    def _call_starts(self) -> tuple[str, ...]:
        return tuple(m for m in (getattr(self.stream_class, n, "") for n in ("START", "PYTHON_TAG")) if m)

    def grammar(self, functions: list[tuple[str, dict]], parallel: bool) -> str:
        """A Lark grammar (llguidance's, with %json for each call) whose sentences are one call (or
        several when parallel) to one of functions [(name, parameters schema)], in this syntax."""
        rules = [f"call_{index}: %json {_call_schema(name, parameters, self.arguments_key)}"
                 for index, (name, parameters) in enumerate(functions)]
        call = " | ".join(f"call_{index}" for index in range(len(functions)))
        return "\n".join([*self._start_rules(parallel), f"call: {call}", *rules]) + "\n"

    def _start_rules(self, parallel: bool) -> list[str]:
        raise NotImplementedError

    def system_prompt(self, tools: list[dict]) -> str:
        raise NotImplementedError

    def calls_text(self, calls: list[tuple[str, dict]]) -> str:
        """Earlier calls [(name, arguments)] as the model would have written them."""
        raise NotImplementedError

    def results_text(self, results: list[str]) -> str:
        """Consecutive tool results, as one user turn's content."""
        raise NotImplementedError


class HermesSyntax(ToolSyntax):
    name = "hermes"
    stream_class = HermesCallStream
    template_markers = ("<tool_call>",)

    def _start_rules(self, parallel: bool) -> list[str]:
        block = r'block: "<tool_call>\n" call "\n</tool_call>"'
        return [r'start: block ("\n" block)*' if parallel else "start: block", block]

    def system_prompt(self, tools: list[dict]) -> str:
        listed = "".join("\n" + _tojson(tool) for tool in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>{listed}\n"
                "</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def calls_text(self, calls: list[tuple[str, dict]]) -> str:
        return "\n".join(f"<tool_call>\n{_tojson({'name': name, 'arguments': arguments})}\n</tool_call>"
                         for name, arguments in calls)

    def results_text(self, results: list[str]) -> str:
        return "\n".join(f"<tool_response>\n{result}\n</tool_response>" for result in results)


class Llama3JsonSyntax(ToolSyntax):
    name = "llama3_json"
    arguments_key = "parameters"
    stream_class = Llama3JsonCallStream
    template_markers = ("<|python_tag|>", "ipython")

    def _start_rules(self, parallel: bool) -> list[str]:
        return ['start: call ("; " call)*' if parallel else "start: call"]

    def call_failed(self, parsed: ParsedOutput) -> bool:
        # Llama 3.1 often writes its call bare, without <|python_tag|>: an output that opens with a
        # {"name" object and parsed to no call is a broken call, not an answer.
        return super().call_failed(parsed) or (not parsed.tool_calls and bool(_BARE_CALL.match(parsed.content or "")))

    def system_prompt(self, tools: list[dict]) -> str:
        listed = "".join(_tojson(tool, indent=4) + "\n\n" for tool in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\nRespond in the format "
                '{"name": function name, "parameters": dictionary of argument name and its value}. '
                f"Do not use variables.\n\n{listed}").rstrip()

    def calls_text(self, calls: list[tuple[str, dict]]) -> str:
        return "; ".join(_tojson({"name": name, "parameters": arguments}) for name, arguments in calls)

    def results_text(self, results: list[str]) -> str:
        return "\n".join(results)


_BARE_CALL = re.compile(r'\s*\{\s*"name"\s*:')

SYNTAXES = {syntax.name: syntax for syntax in (HermesSyntax(), Llama3JsonSyntax())}
if TOOL_CALL_PARSERS != ("auto", *SYNTAXES):  # the flag's choices are declared without importing this module
    raise ImportError(f"gateway.text.tool_syntax_names.TOOL_CALL_PARSERS {TOOL_CALL_PARSERS} does not name "
                      f"the syntaxes here: {tuple(SYNTAXES)}")


@dataclass(frozen=True, slots=True)
class ToolFormat:
    syntax: ToolSyntax
    native: bool  # the chat template renders tools, calls and results itself


@functools.lru_cache(maxsize=16)
def choose_tool_syntax(parser: str, chat_template: str | None) -> ToolFormat:
    """parser: --tool-call-parser ("auto" or a syntax name)."""
    if parser != "auto" and parser not in SYNTAXES:
        raise ValueError(f"--tool-call-parser {parser!r}: must be one of {', '.join(TOOL_CALL_PARSERS)}")
    template = chat_template or ""
    renders_tools = bool(template) and "tools" in template_variables(template)
    if parser == "auto":
        syntax = next((s for s in SYNTAXES.values() if s.writes_this(template)), SYNTAXES["hermes"])
        # a template with tools in a syntax we do not parse gets our prompt instead of its own
        return ToolFormat(syntax, renders_tools and syntax.writes_this(template))
    return ToolFormat(SYNTAXES[parser], renders_tools)


def _call_schema(name: str, parameters: dict, arguments_key: str) -> str:
    """One call as a JSON schema: {"name": <name>, <arguments_key>: <parameters>}, as JSON text for %json."""
    parameters = dict(parameters)
    # the parameters' own definitions move to the root, where their "#/$defs/..." references point
    hoisted = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    schema = {"type": "object", "properties": {"name": {"const": name}, arguments_key: parameters},
              "required": ["name", arguments_key], "additionalProperties": False, **hoisted,
              "x-guidance": _SEPARATORS}
    # "::=" marks a GBNF grammar to plumbing.grammar; inside JSON it can only be in a string, so escape it
    return json.dumps(schema, ensure_ascii=False).replace("::=", "\\u003a:=")


def _tojson(value: object, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)
