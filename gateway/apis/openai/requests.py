"""OpenAI JSON request bodies -> the gateway's one request path (request_builder.prepare_request).

    parsed = parse_completion(body, tokenizer, limits, model_name, request_id)   # POST /v1/completions
    parsed = parse_chat(body, tokenizer, limits, model_name, request_id)         # POST /v1/chat/completions

Every bad value raises InvalidArgument naming the OpenAI field (e.g. "messages[1].content",
"max_completion_tokens"), which becomes a 400 with that field as `param`; an unknown model raises
UnknownModel (404 model_not_found). Fields that would change the result in a way we cannot honour
(the legacy `functions`) are refused with a 400 rather than ignored. Tools (tools, tool_choice,
parallel_tool_calls) are gateway.apis.openai.tools'. n and best_of (both APIs, as vLLM) ask for several
samples (gateway.generation.samples; best_of > n cannot stream). Completions echo with logprobs
asks for prompt logprobs (SamplingParams.prompt_logprobs, as vLLM). Constrained
output (response_format json_object / json_schema, vLLM's guided_json / guided_regex / guided_choice /
guided_grammar) is gateway.prepare.constraints'. vLLM's extra sampling fields (top_k, min_p, repetition_penalty, stop_token_ids,
ignore_eos, priority) are accepted too, and `speculative: false` opts a request out of the server's
speculative decoding (--speculative; the output is the same either way).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

from gateway.prepare.constraints import constraint_field, openai_constraint
from gateway.apis.openai.tools import parse_tools, tool_chat, tool_constraint
from gateway.generation.samples import check_streamable
from gateway.prepare.request_builder import PreparedRequest, chat_token_ids, prepare_request, text_token_ids
from gateway.text.tokenizer import TextTokenizer
from gateway.text.tool_syntax import ToolFormat, ToolSyntax, choose_tool_syntax
from gateway.telemetry import note_tools
from gateway.prepare.validation import ClientSampling, Limits, validate_prompt_ids
from core.errors import InvalidArgument, UnknownModel

# Passed to validate_sampling as they are: OpenAI's own names match ours.
_SAMPLING_FIELDS = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
                    "top_k", "min_p", "repetition_penalty")
_UINT64 = 2**64
MODELS_HINT = " (GET /v1/models)"  # how an OpenAI client lists what is served


@dataclass(slots=True)
class OpenAIRequest:
    prepared: PreparedRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage and no choices
    logprobs: int | None  # top alternatives per token (0: the chosen token's only); None: no logprobs
    echo: str = ""  # completions echo=true: the prompt's text, put before the completion
    # echo with logprobs: the first prompt token's text, listed (with a null logprob) before the prompt
    # logprobs the model computes for the others; None otherwise
    echo_first_token: str | None = None
    tool_syntax: ToolSyntax | None = None  # chat with tools: the output's calls are parsed in this syntax


def parse_completion(body: dict, tokenizer: TextTokenizer, limits: Limits, model_name: str,
                     request_id: str) -> OpenAIRequest:
    _check_common(body, model_name)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise InvalidArgument("echo", echo, "must be true or false")
    _refuse(body, "suffix", lambda v: v is None or v == "", "suffix (insertion) is not supported")
    prompt_ids = _completion_prompt_ids(body.get("prompt"), tokenizer, limits)
    sampling = _sampling(body, "max_tokens")
    sampling["logprobs"] = body.get("logprobs")
    if echo and sampling["logprobs"] is not None:  # as vLLM: the prompt's logprobs, as many alternatives
        sampling["prompt_logprobs"] = sampling["logprobs"]
    parsed = _finish(body, prompt_ids, tokenizer, limits, sampling, request_id, "max_tokens")
    if echo:  # the prompt as the model saw it (a token-id prompt decoded, special tokens kept)
        parsed.echo = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        if sampling["logprobs"] is not None:
            parsed.echo_first_token = tokenizer.decode(prompt_ids[:1], False)
    return parsed


def parse_chat(body: dict, tokenizer: TextTokenizer, limits: Limits, model_name: str,
               request_id: str, tool_format: ToolFormat | None = None) -> OpenAIRequest:
    """tool_format: how the model writes tool calls (--tool-call-parser); None: read from its template."""
    _check_common(body, model_name)
    _refuse(body, "functions", lambda v: not v, "the legacy functions field is not supported; send tools")
    tools = parse_tools(body)
    if tools is not None:  # on the request span, a refusal after this included
        note_tools([tool["function"]["name"] for tool in tools.tools], tools.named or tools.choice)
    messages = body.get("messages")
    if messages is None:
        raise InvalidArgument("messages", None, "is required: a list of {role, content} objects")
    tool_format = tool_format or choose_tool_syntax("auto", tokenizer.chat_template)
    messages, template_kwargs = tool_chat(_text_messages(messages), tools, tool_format, tokenizer.special_tokens)
    prompt_ids = chat_token_ids(messages, tokenizer, limits, **template_kwargs)
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    sampling = _sampling(body, max_field)
    logprobs, top_logprobs = body.get("logprobs"), body.get("top_logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidArgument("logprobs", logprobs, "must be true or false")
    if top_logprobs is not None:
        if not logprobs:
            raise InvalidArgument("top_logprobs", top_logprobs, "needs logprobs: true")
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int) \
                or not 0 <= top_logprobs <= limits.max_logprobs:
            raise InvalidArgument("top_logprobs", top_logprobs, f"must be an integer in [0, {limits.max_logprobs}]")
    sampling["logprobs"] = (top_logprobs or 0) if logprobs else None
    own = sampling["constraint"]
    sampling["constraint"], tool_schemas = tool_constraint(tools, tool_format.syntax, own)
    parsed = _finish(body, prompt_ids, tokenizer, limits, sampling, request_id, max_field)
    if sampling["constraint"] is not own:  # the tools' grammar: each schema is checked under its own name
        parsed.prepared.constraint_field, parsed.prepared.constraint_parts = "tools", tool_schemas
    if tools is not None and tools.parses_output:
        parsed.tool_syntax = parsed.prepared.tool_syntax = tool_format.syntax
    return parsed


def _finish(body: dict, prompt_ids: list[int], tokenizer: TextTokenizer, limits: Limits, sampling: dict,
            request_id: str, max_field: str) -> OpenAIRequest:
    with _renamed("max_tokens", max_field):
        client = ClientSampling(**sampling, stop_token_ids=body.get("stop_token_ids"),
                                ignore_eos=body.get("ignore_eos"), speculative=body.get("speculative"))
        prepared = prepare_request(prompt_ids, tokenizer, limits, sampling=client, stop=body.get("stop"),
                                   request_id=request_id, priority=body.get("priority"), n=body.get("n"),
                                   best_of=body.get("best_of"))
    prepared.constraint_field = constraint_field(body)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidArgument("stream", stream, "must be true or false")
    if stream:
        check_streamable(prepared)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidArgument("stream_options", options, 'must be an object like {"include_usage": true}')
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidArgument("stream_options.include_usage", include_usage, "must be true or false")
    return OpenAIRequest(prepared, bool(stream), include_usage, prepared.request.sampling_params.logprobs)


def _check_common(body: dict, model_name: str) -> None:
    model = body.get("model")
    if model not in (None, "", model_name):
        if not isinstance(model, str):
            raise InvalidArgument("model", model, "must be a string")
        raise UnknownModel(model, model_name, MODELS_HINT)


def _refuse(body: dict, field: str, acceptable, reason: str) -> None:
    value = body.get(field)
    if not acceptable(value):
        raise InvalidArgument(field, value, reason)


def _sampling(body: dict, max_field: str) -> dict:
    sampling = {name: body.get(name) for name in _SAMPLING_FIELDS}
    seed = sampling["seed"]
    if isinstance(seed, int) and not isinstance(seed, bool) and -(2**63) <= seed < 0:
        sampling["seed"] = seed + _UINT64  # OpenAI seeds are int64; ours are the same 64 bits unsigned
    sampling["max_tokens"] = body.get(max_field)
    sampling["constraint"] = openai_constraint(body)
    sampling["logit_bias"] = body.get("logit_bias")
    return sampling


@contextlib.contextmanager
def _renamed(field: str, alias: str):
    """Report errors in `field` under the name the client used for it."""
    try:
        yield
    except InvalidArgument as error:
        if error.field != field or alias == field:
            raise
        raise InvalidArgument(alias, error.value, error.limit_or_reason) from None


def _completion_prompt_ids(prompt: object, tokenizer: TextTokenizer, limits: Limits) -> list[int]:
    """A string, a list of token ids, or a batch of exactly one of those."""
    if isinstance(prompt, list) and prompt and all(isinstance(item, (str, list)) for item in prompt):
        if len(prompt) != 1:
            raise InvalidArgument("prompt", prompt, f"holds {len(prompt)} prompts; send one prompt per request")
        prompt = prompt[0]
    if isinstance(prompt, list):
        try:
            return validate_prompt_ids(prompt, limits)
        except InvalidArgument as error:  # "prompt_token_ids[3]" -> "prompt[3]", the name the client used
            field = "prompt" + error.field.removeprefix("prompt_token_ids")
            raise InvalidArgument(field, error.value, error.limit_or_reason) from None
    if prompt is None:
        raise InvalidArgument("prompt", None, "is required: a string or a list of token ids")
    return text_token_ids(prompt, tokenizer, limits)


def _text_messages(messages: object) -> object:
    """OpenAI messages -> [{"role", "content": str}]; content parts must be text. Anything that is
    not a list of objects is handed on unchanged for chat_template.validate_messages to name."""
    if not isinstance(messages, list):
        return messages
    out: list[object] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            out.append(message)
            continue
        content = message.get("content")
        if content is None and message.get("role") == "assistant":
            content = ""  # an assistant turn that only called tools
        if isinstance(content, list):
            content = "".join(_text_part(part, f"messages[{index}].content[{j}]") for j, part in enumerate(content))
        turn = {key: message[key] for key in ("role", "content", "tool_calls", "tool_call_id") if key in message}
        if content is not None or "content" in turn:
            turn["content"] = content
        if turn.get("role") == "developer":  # OpenAI's newer name for the system turn
            turn["role"] = "system"
        out.append(turn)
    return out


def _text_part(part: object, field: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise InvalidArgument(field, kind, 'only text parts ({"type": "text", "text": ...}) are supported')
    return part["text"]
