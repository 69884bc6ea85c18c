"""Request validation at the edge: every bad value a client can send becomes InvalidArgument naming
the field, the value and the limit ("invalid max_tokens=0: must be in [1, 4096]"), before anything
reaches a scheduler.

    limits = Limits(max_model_len=8192, vocab_size=tokenizer.vocab_size)
    prompt_ids = validate_prompt_ids(ids, limits)
    params = validate_sampling(limits, ClientSampling(max_tokens=..., temperature=...), prompt_len=len(prompt_ids))
    stop = validate_stop_strings(request_stop, limits)
    priority = validate_priority(request_priority, limits)

Fields left as None take the server default (SamplingParams' defaults, Limits.default_max_tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

from core.errors import InvalidArgument
from core.sampling import (MAX_LOGIT_BIAS, MAX_LOGPROBS, OutputConstraint, SamplingLimits, SamplingParams,
                           check_float_range, check_int_range, check_sampling_field, is_int)
from plumbing.constraint_limits import check_size


@dataclass(frozen=True, slots=True)
class Limits:
    """What one server accepts; built from its config (max_model_len, vocab_size from the model)."""

    max_model_len: int = 8192  # prompt + output tokens
    max_tokens_limit: int = 4096  # most output tokens one request may ask for
    default_max_tokens: int = 256  # when the client leaves max_tokens unset (capped by the context left)
    vocab_size: int = 49152
    max_prompt_chars: int = 500_000  # raw prompt text, or all message contents together, before tokenizing
    max_messages: int = 1024
    max_stop_strings: int = 16
    max_stop_string_len: int = 256  # characters
    max_stop_token_ids: int = 64
    max_logit_bias_entries: int = 300  # OpenAI's limit
    max_logprobs: int = MAX_LOGPROBS
    max_temperature: float = 100.0  # far past uniform sampling already; caps only nonsense
    max_repetition_penalty: float = 100.0
    min_priority: int = -1_000_000
    max_priority: int = 1_000_000
    max_samples: int = 16  # n and best_of: samples one request may draw (each is a sequence in the batch)

    @property
    def sampling_limits(self) -> SamplingLimits:
        return SamplingLimits(max_tokens=self.max_tokens_limit, max_temperature=self.max_temperature,
                              max_repetition_penalty=self.max_repetition_penalty, max_abs_penalty=2.0,
                              max_logprobs=self.max_logprobs)


def validate_prompt_text(prompt: object, limits: Limits) -> str:
    """A raw text prompt: a non-empty string of at most max_prompt_chars characters."""
    if not isinstance(prompt, str):
        raise InvalidArgument("prompt", prompt, f"must be a string, not {type(prompt).__name__}")
    if not prompt:
        raise InvalidArgument("prompt", prompt, "must not be empty")
    _check_at_most("prompt", prompt, len(prompt), limits.max_prompt_chars, "characters")
    return prompt


def validate_chat_size(messages: list, limits: Limits) -> None:
    """Bound a chat before rendering it (its shape is checked by chat_template.validate_messages)."""
    _check_at_most("messages", messages, len(messages), limits.max_messages, "messages")
    contents = [m["content"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)]
    total = sum(len(content) for content in contents)
    _check_at_most("messages", messages, total, limits.max_prompt_chars, "characters of content in all")


def validate_prompt_ids(prompt_ids: object, limits: Limits) -> list[int]:
    """Token ids: non-empty, inside the vocabulary, leaving room for at least one generated token."""
    if not isinstance(prompt_ids, (list, tuple)):
        reason = f"must be a list of token ids, not {type(prompt_ids).__name__}"
        raise InvalidArgument("prompt_token_ids", prompt_ids, reason)
    if not prompt_ids:
        raise InvalidArgument("prompt_token_ids", prompt_ids, "must hold at least one token")
    # One token of the context must stay free for the first generated token.
    limit = limits.max_model_len - 1
    unit = f"tokens (max_model_len={limits.max_model_len} - 1)"
    _check_at_most("prompt_token_ids", prompt_ids, len(prompt_ids), limit, unit)
    for index, token_id in enumerate(prompt_ids):
        _check_token_id(f"prompt_token_ids[{index}]", token_id, limits)
    return list(prompt_ids)


# A client's value before validation: whatever its JSON or protobuf field held (validation names the
# field, the value and the limit when it is not what the field takes)
Unchecked = object


@dataclass(frozen=True, slots=True)
class ClientSampling:
    """The sampling fields as a client sent them, built at each API edge from its own wire format and
    checked by validate_sampling. None means unset: the server default (SamplingParams', Limits')."""

    max_tokens: Unchecked = None
    temperature: Unchecked = None
    top_p: Unchecked = None
    top_k: Unchecked = None
    min_p: Unchecked = None
    repetition_penalty: Unchecked = None
    presence_penalty: Unchecked = None
    frequency_penalty: Unchecked = None
    seed: Unchecked = None
    stop_token_ids: Unchecked = None
    ignore_eos: Unchecked = None
    logprobs: Unchecked = None
    prompt_logprobs: Unchecked = None
    constraint: OutputConstraint | None = None  # parsed from the client's own fields (gateway.prepare.constraints)
    logit_bias: Unchecked = None
    speculative: Unchecked = None  # False: opt out of the server's speculative decoding


def validate_sampling(limits: Limits, sampling: ClientSampling = ClientSampling(), *,
                      prompt_len: int | None = None) -> SamplingParams:
    """Check each field against its range; with prompt_len, also that prompt + max_tokens fits the context."""
    defaults = SamplingParams()
    max_tokens, constraint = sampling.max_tokens, sampling.constraint
    room = limits.max_model_len - prompt_len if prompt_len is not None else limits.max_tokens_limit
    if max_tokens is None:
        max_tokens = max(1, min(limits.default_max_tokens, limits.max_tokens_limit, room))
    else:
        check_sampling_field("max_tokens", max_tokens, limits.sampling_limits)
        if prompt_len is not None and prompt_len + max_tokens > limits.max_model_len:  # type: ignore[operator]
            raise InvalidArgument(
                "max_tokens",
                max_tokens,
                f"prompt_tokens={prompt_len} + max_tokens must be <= max_model_len={limits.max_model_len} "
                f"(at most {max(room, 0)} here)",
            )
    sampling_limits = limits.sampling_limits
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed", "logprobs", "prompt_logprobs", "ignore_eos", "speculative"):
        check_sampling_field(name, getattr(sampling, name), sampling_limits)
    if constraint is not None:
        check_size(constraint)  # the rest is checked in the grammar sandbox (check_constraints)
    return SamplingParams(
        max_tokens=max_tokens,  # type: ignore[arg-type]
        temperature=_float_or(sampling.temperature, defaults.temperature),
        top_k=sampling.top_k if sampling.top_k is not None else defaults.top_k,  # type: ignore[arg-type]
        top_p=_float_or(sampling.top_p, defaults.top_p),
        min_p=_float_or(sampling.min_p, defaults.min_p),
        repetition_penalty=_float_or(sampling.repetition_penalty, defaults.repetition_penalty),
        presence_penalty=_float_or(sampling.presence_penalty, defaults.presence_penalty),
        frequency_penalty=_float_or(sampling.frequency_penalty, defaults.frequency_penalty),
        seed=sampling.seed,  # type: ignore[arg-type]
        stop_token_ids=_validate_stop_token_ids(sampling.stop_token_ids, limits),
        ignore_eos=bool(sampling.ignore_eos),
        logprobs=sampling.logprobs,  # type: ignore[arg-type]
        prompt_logprobs=sampling.prompt_logprobs,  # type: ignore[arg-type]
        constraint=constraint,
        logit_bias=_validate_logit_bias(sampling.logit_bias, limits),
        speculative=sampling.speculative is not False,
    )


def validate_stop_strings(stop: object, limits: Limits) -> list[str]:
    """At most max_stop_strings non-empty strings of at most max_stop_string_len characters."""
    if stop is None:
        return []
    if isinstance(stop, str):  # OpenAI accepts a single string
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise InvalidArgument("stop", stop, f"must be a string or a list of strings, not {type(stop).__name__}")
    _check_at_most("stop", stop, len(stop), limits.max_stop_strings, "strings")
    for index, text in enumerate(stop):
        if not isinstance(text, str):
            raise InvalidArgument(f"stop[{index}]", text, "must be a string")
        if not text:
            raise InvalidArgument(f"stop[{index}]", text, "must not be empty")
        _check_at_most(f"stop[{index}]", text, len(text), limits.max_stop_string_len, "characters")
    return list(stop)


def validate_priority(priority: object, limits: Limits) -> int:
    if priority is None:
        return 0
    check_int_range("priority", priority, limits.min_priority, limits.max_priority)
    return priority  # type: ignore[return-value]


def validate_samples(n: object, best_of: object, limits: Limits) -> tuple[int, int]:
    """(n, best_of): n choices returned, the best of best_of samples drawn (unset: n); both in
    [1, max_samples] and best_of >= n."""
    n = 1 if n is None else n
    check_int_range("n", n, 1, limits.max_samples)
    if best_of is None:
        return n, n  # type: ignore[return-value]
    check_int_range("best_of", best_of, 1, limits.max_samples)
    if best_of < n:  # type: ignore[operator]
        raise InvalidArgument("best_of", best_of, f"must be >= n ({n}): the n best of best_of samples are returned")
    return n, best_of  # type: ignore[return-value]


def _validate_logit_bias(logit_bias: object, limits: Limits) -> tuple[tuple[int, float], ...]:
    """{token id (an int, or its decimal string as JSON keys are): bias in [-100, 100]} -> sorted pairs."""
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, dict):
        raise InvalidArgument("logit_bias", logit_bias, "must be an object mapping token ids to biases")
    _check_at_most("logit_bias", "...", len(logit_bias), limits.max_logit_bias_entries, "entries")
    pairs = {}
    for key, bias in logit_bias.items():
        token_id = int(key) if isinstance(key, str) and key.strip().lstrip("-").isdigit() else key
        _check_token_id(f"logit_bias[{key!r}]", token_id, limits)
        check_float_range(f"logit_bias[{key!r}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        pairs[token_id] = float(bias)
    return tuple(sorted(pairs.items()))


def _validate_stop_token_ids(stop_token_ids: object, limits: Limits) -> tuple[int, ...]:
    if stop_token_ids is None:
        return ()
    if not isinstance(stop_token_ids, (list, tuple)):
        reason = f"must be a list of token ids, not {type(stop_token_ids).__name__}"
        raise InvalidArgument("stop_token_ids", stop_token_ids, reason)
    _check_at_most("stop_token_ids", stop_token_ids, len(stop_token_ids), limits.max_stop_token_ids, "ids")
    for index, token_id in enumerate(stop_token_ids):
        _check_token_id(f"stop_token_ids[{index}]", token_id, limits)
    return tuple(stop_token_ids)


def _check_token_id(field: str, token_id: object, limits: Limits) -> None:
    if not is_int(token_id) or not 0 <= token_id < limits.vocab_size:  # type: ignore[operator]
        reason = f"must be a token id in [0, {limits.vocab_size - 1}] (vocab_size={limits.vocab_size})"
        raise InvalidArgument(field, token_id, reason)


def _check_at_most(field: str, value: object, count: int, limit: int, unit: str) -> None:
    if count > limit:
        raise InvalidArgument(field, value, f"must hold at most {limit} {unit}, got {count}")


def _float_or(value: object, default: float) -> float:
    return float(value) if value is not None else default  # type: ignore[arg-type]
