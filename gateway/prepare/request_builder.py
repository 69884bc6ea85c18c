"""A client's request -> a validated, tokenized GenerationRequest (everything a client can get wrong).

Every public API funnels through prepare_request: the tokenmill.v1 GenerateRequest (prepare) and the
HTTP/JSON front ends, which turn their own fields into prompt ids (text_token_ids / chat_token_ids)
and a ClientSampling of the sampling fields, so the same value gets the same verdict whichever API sent it.
"""
from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field

from gateway.prepare.chat_encoding import encode_chat
from gateway.text.chat_template import validate_messages
from gateway.text.tokenizer import TextTokenizer, default_model_path
from gateway.text.tool_syntax import ToolSyntax
from gateway.telemetry import note_constraint
from gateway.prepare.validation import (ClientSampling, Limits, validate_chat_size, validate_priority,
                                        validate_prompt_ids, validate_prompt_text, validate_sampling,
                                        validate_samples, validate_stop_strings)
from protos.codec import constraint_from_proto
from protos.tokenmill.v1 import generation_pb2
from core.requests import GenerationRequest
from core.errors import InvalidArgument, UnknownModel
from core.sampling import OutputConstraint
from plumbing.grammar_sandbox import GrammarSandbox

_OPTIONAL_PARAMS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "logprobs", "prompt_logprobs", "speculative")
MAX_REQUEST_ID_LEN = 256


@dataclass(slots=True)
class PreparedRequest:
    request: GenerationRequest
    stop: list[str]
    n: int = 1  # choices to return (gateway.generation.samples draws them)
    best_of: int = 1  # samples to draw, of which the n with the highest cumulative logprob are returned
    constraint_field: str | None = None  # the field the client sent its constraint in (None: its kind)
    # parts of the constraint checked first under their own names (a tools grammar's parameter schemas)
    constraint_parts: list[tuple[OutputConstraint, str]] = field(default_factory=list)
    # a chat with tools whose output is parsed for calls (OpenAI tool_choice other than none): its syntax
    tool_syntax: ToolSyntax | None = None


def sandbox_or_default(sandbox: GrammarSandbox | None) -> GrammarSandbox:
    """The gateway's sandbox (gateway.main builds it from its flags), or one for the default model whose
    helpers start on the first constrained request (an API built without one, as tests build them)."""
    return sandbox if sandbox is not None else GrammarSandbox(default_model_path())


async def check_constraints(prepared: PreparedRequest, sandbox: GrammarSandbox) -> None:
    """Compiles the request's constraint in the grammar sandbox (each distinct one once; InvalidArgument
    naming the client's field when it does not compile or breaks a limit) and puts its forwarded form,
    GBNF converted to Lark, in the request. Every API calls it after prepare, before routing."""
    constraint = prepared.request.sampling_params.constraint
    if constraint is None:
        return
    started = time.perf_counter()
    for part, name in prepared.constraint_parts:
        await sandbox.check(part, name)
    forwarded = await sandbox.check(constraint, prepared.constraint_field)
    note_constraint(constraint, prepared.constraint_field, time.perf_counter() - started)
    if forwarded != constraint:
        params = dataclasses.replace(prepared.request.sampling_params, constraint=forwarded)
        prepared.request = dataclasses.replace(prepared.request, sampling_params=params)


def text_token_ids(text: object, tokenizer: TextTokenizer, limits: Limits,
                   add_special_tokens: bool = True) -> list[int]:
    validate_prompt_text(text, limits)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)  # type: ignore[arg-type]


def chat_token_ids(messages: list[dict], tokenizer: TextTokenizer, limits: Limits, **template_kwargs) -> list[int]:
    """[{"role", "content"}, ...] rendered with the chat template (generation prompt appended);
    template_kwargs: more variables for it (the OpenAI API's tools=)."""
    if not messages:
        raise InvalidArgument("messages", [], "must hold at least one message")
    validate_messages(messages)
    validate_chat_size(messages, limits)
    if not tokenizer.chat_template:
        raise InvalidArgument("messages", "...", "this model has no chat template; send a prompt")
    return encode_chat(tokenizer, messages, **template_kwargs)  # the template writes the specials; content stays text


def prompt_token_ids(message: generation_pb2.GenerateRequest | generation_pb2.TokenizeRequest,
                     tokenizer: TextTokenizer, limits: Limits, add_special_tokens: bool = True) -> list[int]:
    which = message.WhichOneof("input")
    if which == "messages":
        messages = [{"role": m.role, "content": m.content} for m in message.messages.messages]
        return chat_token_ids(messages, tokenizer, limits)
    text = message.prompt if which == "prompt" else getattr(message, "text", "")
    return text_token_ids(text, tokenizer, limits, add_special_tokens)


def resolve_request_id(request_id: str) -> str:
    """The client's id (checked), or a fresh one when it sent none."""
    request_id = request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidArgument("request_id", request_id, f"must be at most {MAX_REQUEST_ID_LEN} characters")
    return request_id


def prepare_request(prompt_ids: list[int], tokenizer: TextTokenizer, limits: Limits, *,
                    sampling: ClientSampling = ClientSampling(), stop: object = None, request_id: str = "",
                    priority: object = 0, n: object = None, best_of: object = None) -> PreparedRequest:
    """sampling: the client's sampling fields, unchecked (validate_sampling checks them); None means unset.
    n, best_of: samples of one prompt (validate_samples); None: one."""
    request_id = resolve_request_id(request_id)
    n, best_of = validate_samples(n, best_of, limits)
    ids = validate_prompt_ids(prompt_ids, limits)
    stop_token_ids = [] if sampling.stop_token_ids is None else sampling.stop_token_ids
    # the model's other end-of-turn tokens too
    if not sampling.ignore_eos and isinstance(stop_token_ids, (list, tuple)):
        stop_token_ids = [*stop_token_ids, *(t for t in tokenizer.stop_token_ids if t not in stop_token_ids)]
    params = validate_sampling(limits, dataclasses.replace(sampling, stop_token_ids=stop_token_ids), prompt_len=len(ids))
    stop = validate_stop_strings(stop, limits)
    request = GenerationRequest(request_id, ids, params, eos_token_id=tokenizer.eos_token_id,
                      priority=validate_priority(priority, limits))
    return PreparedRequest(request, stop, n, best_of)


def _logit_bias(entries) -> dict[int, float]:
    biases: dict[int, float] = {}
    for entry in entries:
        if entry.token_id in biases:
            raise InvalidArgument("parameters.logit_bias", entry.token_id, "names this token id twice")
        biases[entry.token_id] = entry.bias
    return biases


def prepare(message: generation_pb2.GenerateRequest, tokenizer: TextTokenizer, limits: Limits,
            model_name: str) -> PreparedRequest:
    if message.model and message.model != model_name:
        raise UnknownModel(message.model, model_name)
    request_id = resolve_request_id(message.request_id)
    ids = prompt_token_ids(message, tokenizer, limits)
    params = message.parameters
    sampling = {name: getattr(params, name) for name in _OPTIONAL_PARAMS if params.HasField(name)}
    if params.HasField("constraint"):
        sampling["constraint"] = constraint_from_proto(params.constraint)
    if params.logit_bias:
        sampling["logit_bias"] = _logit_bias(params.logit_bias)
    samples = {name: getattr(params, name) for name in ("n", "best_of") if params.HasField(name)}
    client = ClientSampling(**sampling, stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos)
    return prepare_request(ids, tokenizer, limits, sampling=client, stop=list(params.stop), request_id=request_id,
                           priority=message.priority, **samples)
