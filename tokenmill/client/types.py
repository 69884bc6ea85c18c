"""What the client returns (plain dataclasses) and how requests are built: protobuf stays in here."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from protos.tokenmill.v1 import common_pb2, generation_pb2

# The keyword parameters generate() and stream() accept, as in GenerateParameters.
SCALAR_PARAMS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "seed", "logprobs")
LIST_PARAMS = ("stop", "stop_token_ids")


class ClientError(Exception):
    """A call failed with a gRPC status (after any retries).

    code: grpc.StatusCode; details: the server's message (it names the field, value and limit for
    INVALID_ARGUMENT); attempts: how many times it was sent; retry_after_s: the server's hint on
    RESOURCE_EXHAUSTED, when it gave one."""

    def __init__(self, code: grpc.StatusCode, details: str, attempts: int = 1,
                 retry_after_s: float | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.attempts = attempts
        self.retry_after_s = retry_after_s

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError, attempts: int) -> ClientError:
        retry_after_s = None
        for key, value in error.trailing_metadata() or ():  # type: ignore[attr-defined]
            if key == "retry-after-ms" and str(value).isdigit():
                retry_after_s = int(value) / 1000
        return cls(error.code(), error.details() or "", attempts, retry_after_s)  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class TopLogprob:
    """One of the most likely tokens at a position: its id, its text and its log-probability."""

    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True, slots=True)
class Logprob(TopLogprob):
    """The token generated at a position, with the alternatives the request asked for."""

    top: tuple[TopLogprob, ...] = ()  # best first


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one generation; cached_prompt_tokens of the prompt came from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int

    @property
    def total_tokens(self) -> int:
        """prompt + completion, as OpenAI's usage reports it."""
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True, slots=True)
class Timings:
    """Measured at the gateway, in seconds."""

    queue_s: float
    time_to_first_token_s: float
    decode_s: float
    e2e_s: float


@dataclass(frozen=True, slots=True)
class Delta:
    """One streamed piece; finish_reason, usage and timings are set on the last one only."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[Logprob, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    matched_stop: str = ""
    usage: Usage | None = None
    timings: Timings | None = None


@dataclass(slots=True)
class GenerationResult:
    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str = ""
    usage: Usage | None = None
    timings: Timings | None = None

    def add(self, delta: Delta) -> None:
        self.request_id = delta.request_id
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.matched_stop = delta.finish_reason, delta.matched_stop
            self.usage, self.timings = delta.usage, delta.timings


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    architecture: str
    vocab_size: int
    max_context_length: int
    dtype: str
    quantization: str
    has_chat_template: bool
    eos_token_id: int | None
    bos_token_id: int | None
    device: str
    block_size: int  # tokens per KV page
    num_blocks: int  # KV pages
    kv_cache_policy: str  # "paged" | "static"


@dataclass(frozen=True, slots=True)
class RequestStatus:
    request_id: str
    status: str  # "queued" | "running" | "finished" | "failed" | "cancelled"
    finish_reason: str | None
    error: str
    num_preemptions: int
    num_prompt_tokens: int
    num_output_tokens: int


# -- building requests -----------------------------------------------------------------------------


def generate_request(prompt: str | Sequence[dict] | None, messages: Sequence[dict] | None, model: str,
                     request_id: str, priority: int, params: dict) -> generation_pb2.GenerateRequest:
    """prompt: text, or chat messages [{"role", "content"}] (the same as passing messages=)."""
    if prompt is not None and not isinstance(prompt, str):  # chat messages as the first argument
        if messages is not None:
            raise TypeError("pass chat messages either as the first argument or as messages=, not both")
        prompt, messages = None, prompt
    if (prompt is None) == (messages is None):
        raise TypeError("pass exactly one of prompt (text) and messages ([{'role', 'content'}, ...])")
    unknown = sorted(set(params) - set(SCALAR_PARAMS) - set(LIST_PARAMS) - {"ignore_eos"})
    if unknown:
        raise TypeError(f"unknown generation parameter(s) {unknown}; known: "
                        f"{sorted((*SCALAR_PARAMS, *LIST_PARAMS, 'ignore_eos'))}")
    parameters = generation_pb2.GenerateParameters(ignore_eos=bool(params.get("ignore_eos", False)))
    for name in SCALAR_PARAMS:  # only what was given: unset means the server default, not zero
        if params.get(name) is not None:
            setattr(parameters, name, params[name])
    stop = params.get("stop")
    parameters.stop.extend([stop] if isinstance(stop, str) else stop or [])
    parameters.stop_token_ids.extend(params.get("stop_token_ids") or [])
    request = generation_pb2.GenerateRequest(model=model, parameters=parameters, request_id=request_id,
                                             priority=priority)
    if messages is not None:
        request.messages.CopyFrom(chat_messages(messages))
    else:
        request.prompt = prompt  # type: ignore[assignment]
    return request


def chat_messages(messages: Sequence[dict]) -> generation_pb2.ChatMessages:
    return generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role=m["role"], content=m["content"])
                                                 for m in messages])


# -- reading replies ----------------------------------------------------------------------------------

_FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
           common_pb2.FINISH_REASON_ABORT: "abort", common_pb2.FINISH_REASON_ERROR: "error"}


def delta_from_proto(message: generation_pb2.GenerateStreamResponse) -> Delta:
    last = message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    timings = message.timings
    return Delta(
        request_id=message.request_id, text=message.text, token_ids=tuple(message.token_ids),
        logprobs=tuple(Logprob(p.token_id, p.token, p.logprob,
                               tuple(TopLogprob(t.token_id, t.token, t.logprob) for t in p.top_logprobs))
                       for p in message.logprobs),
        finish_reason=_FINISH.get(message.finish_reason), matched_stop=message.matched_stop,
        usage=Usage(message.usage.prompt_tokens, message.usage.completion_tokens,
                    message.usage.cached_prompt_tokens) if last else None,
        timings=Timings(timings.queue_ns / 1e9, timings.time_to_first_token_ns / 1e9, timings.decode_ns / 1e9,
                        timings.e2e_ns / 1e9) if last else None)


def model_info_from_proto(reply: common_pb2.GetModelInfoResponse) -> ModelInfo:
    config = reply.model_config
    return ModelInfo(
        name=config.name, architecture=config.architecture, vocab_size=config.vocab_size,
        max_context_length=config.max_context_length, dtype=config.dtype, quantization=config.quantization,
        has_chat_template=config.has_chat_template,
        eos_token_id=config.eos_token_id if config.HasField("eos_token_id") else None,
        bos_token_id=config.bos_token_id if config.HasField("bos_token_id") else None,
        device=reply.device, block_size=reply.block_size, num_blocks=reply.num_blocks,
        kv_cache_policy=common_pb2.KvCachePolicy.Name(reply.kv_cache_policy).removeprefix("KV_CACHE_POLICY_").lower())


def request_status_from_proto(reply: generation_pb2.GetRequestStatusResponse) -> RequestStatus:
    return RequestStatus(
        request_id=reply.request_id,
        status=generation_pb2.RequestStatus.Name(reply.status).removeprefix("REQUEST_STATUS_").lower(),
        finish_reason=_FINISH.get(reply.finish_reason), error=reply.error, num_preemptions=reply.num_preemptions,
        num_prompt_tokens=reply.num_prompt_tokens, num_output_tokens=reply.num_output_tokens)
