"""Public GenerateRequest -> a validated, tokenized SubmitRequest (everything a client can get wrong)."""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from gateway.chat_template import render_chat, validate_messages
from gateway.tokenizer import TextTokenizer
from gateway.validation import (Limits, validate_chat_size, validate_priority, validate_prompt_ids,
                                validate_prompt_text, validate_sampling, validate_stop_strings)
from protos.tokenmill.v1 import generation_pb2
from scheduler.request import Request
from tokenmill.errors import InvalidArgument

_OPTIONAL_PARAMS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "logprobs")
MAX_REQUEST_ID_LEN = 256


@dataclass(slots=True)
class PreparedRequest:
    request: Request
    stop: list[str]


def prompt_token_ids(message: generation_pb2.GenerateRequest | generation_pb2.TokenizeRequest,
                     tokenizer: TextTokenizer, limits: Limits, add_special_tokens: bool = True) -> list[int]:
    which = message.WhichOneof("input")
    if which == "messages":
        messages = [{"role": m.role, "content": m.content} for m in message.messages.messages]
        if not messages:
            raise InvalidArgument("messages", [], "must hold at least one message")
        validate_messages(messages)
        validate_chat_size(messages, limits)
        if not tokenizer.chat_template:
            raise InvalidArgument("messages", "...", "this model has no chat template; send a prompt")
        text = render_chat(tokenizer.chat_template, messages, add_generation_prompt=True,
                           bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
        return tokenizer.encode(text, add_special_tokens=False)  # the template wrote the specials
    text = message.prompt if which == "prompt" else getattr(message, "text", "")
    validate_prompt_text(text, limits)
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def prepare(message: generation_pb2.GenerateRequest, tokenizer: TextTokenizer, limits: Limits,
            model_name: str) -> PreparedRequest:
    if message.model and message.model != model_name:
        raise InvalidArgument("model", message.model, f"unknown model; this server serves {model_name!r}")
    request_id = message.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidArgument("request_id", request_id, f"must be at most {MAX_REQUEST_ID_LEN} characters")
    ids = validate_prompt_ids(prompt_token_ids(message, tokenizer, limits), limits)
    params = message.parameters
    fields = {name: getattr(params, name) for name in _OPTIONAL_PARAMS if params.HasField(name)}
    stop_token_ids = list(params.stop_token_ids)
    if not params.ignore_eos:  # the model's other end-of-turn tokens stop it too
        stop_token_ids += [t for t in tokenizer.stop_token_ids if t not in stop_token_ids]
    sampling = validate_sampling(limits, prompt_len=len(ids), stop_token_ids=stop_token_ids,
                                 ignore_eos=params.ignore_eos, **fields)
    stop = validate_stop_strings(list(params.stop), limits)
    priority = validate_priority(message.priority, limits)
    request = Request(request_id, ids, sampling, eos_token_id=tokenizer.eos_token_id, priority=priority)
    return PreparedRequest(request, stop)
