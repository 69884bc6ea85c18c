"""Render a chat into the prompt text a model was trained on, with its own Jinja chat template.

Chat templates come with model files, so they are untrusted code: they run in Jinja's immutable
sandbox, configured as transformers' apply_chat_template does (trim_blocks, lstrip_blocks, the
loopcontrols extension, raise_exception / strftime_now globals, a tojson that keeps non-ASCII), so
the same template gives the same text here as there.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from core.errors import InvalidArgument


# The roles every chat template knows; OpenAI's "developer" is mapped to "system" before this check.
CHAT_ROLES = ("system", "user", "assistant", "tool")


class TemplateRaised(jinja2.exceptions.TemplateError):
    """The template itself rejected the chat (it called raise_exception)."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


@functools.lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template (a server has one or a few)."""
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ValueError(f"chat template does not compile: {error.message} (line {error.lineno})") from error


@functools.lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from its caller (messages, tools, add_generation_prompt, ...):
    whether it renders tools itself is whether it reads `tools`."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.exceptions.TemplateSyntaxError as error:
        raise ValueError(f"chat template does not compile: {error.message} (line {error.lineno})") from error


def render_chat(
    template: str,
    messages: object,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    **template_kwargs: object,
) -> str:
    """The prompt text for `messages` ([{"role": str, "content": str, ...}, ...]).

    Raises InvalidArgument naming the field (e.g. "messages[2].role") when the chat is malformed or
    when the template rejects it (roles not alternating, an unknown role, ...).
    """
    validate_messages(messages)
    compiled = compile_chat_template(template)
    try:
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token or "",
            eos_token=eos_token or "",
            **template_kwargs,
        )
    except TemplateRaised as error:
        roles = [message["role"] for message in messages]  # type: ignore[union-attr,index]
        reason = f"rejected by the chat template: {error.message}"
        raise InvalidArgument("messages", {"roles": roles}, reason) from error


def validate_messages(messages: object) -> None:
    """Check the shape every chat template relies on; raise InvalidArgument naming field and index."""
    if not isinstance(messages, list):
        reason = f"must be a list of {{role, content}} objects, not {type(messages).__name__}"
        raise InvalidArgument("messages", messages, reason)
    if not messages:
        raise InvalidArgument("messages", messages, "must hold at least one message")
    for index, message in enumerate(messages):
        field = f"messages[{index}]"
        if not isinstance(message, dict):
            reason = f"must be an object with role and content, not {type(message).__name__}"
            raise InvalidArgument(field, message, reason)
        for key in ("role", "content"):
            if key not in message:
                raise InvalidArgument(f"{field}.{key}", None, f"is required: every message needs a string {key}")
            value = message[key]
            if not isinstance(value, str):
                raise InvalidArgument(f"{field}.{key}", value, f"must be a string, not {type(value).__name__}")
        if not message["role"]:
            raise InvalidArgument(f"{field}.role", "", "must not be empty")
        if message["role"] not in CHAT_ROLES:  # a template may print any role verbatim as a turn header
            raise InvalidArgument(f"{field}.role", message["role"], f"must be one of {', '.join(CHAT_ROLES)}")
