"""How to pick each next token, and the one range check of those parameters.

The gateway checks what a public client sends against its public limits (SamplingLimits built from its
flags); the scheduler checks what reaches its internal API against what a worker can run at all (the
defaults here: a NaN temperature or a zero top_p would turn a whole batch's logits into NaN). Both call
check_sampling_field, so one value gets one verdict and one message, whichever door it came through.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from core.errors import InvalidArgument

# Below this temperature a row is sampled greedily (vLLM's rule): dividing by it could overflow the
# logits to inf. The one definition every sampler (torch and Triton) and SamplingParams.greedy use.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # alternatives per token a request may ask for
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
# int64 from JSON clients, uint64 from the proto; the worker masks seeds to 64 bits
SEED_RANGE = (-(2**63), 2**64 - 1)


class ConstraintKind(enum.Enum):
    """What a request's output must match (constrained decoding; plumbing.grammar compiles each kind)."""

    JSON_SCHEMA = "json_schema"  # value: the schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; value unused ("")
    REGEX = "regex"  # value: the regular expression (the whole output matches it)
    CHOICE = "choice"  # choices: the output is exactly one of them
    GRAMMAR = "grammar"  # value: a Lark or GBNF (llama.cpp) grammar


@dataclass(slots=True, frozen=True)
class OutputConstraint:
    """One constraint on a request's whole output. Tokens that would break it are masked before
    sampling, so the output parses (or, stopped by max_tokens, is a valid prefix). Content addressed:
    two equal constraints compile once (the worker caches compiled grammars by content)."""

    kind: ConstraintKind
    value: str = ""
    choices: tuple[str, ...] = ()


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Defaults follow vLLM."""

    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_TEMPERATURE means greedy
    top_k: int = -1  # -1 (or 0) disables
    top_p: float = 1.0  # in (0, 1]; 1 disables
    min_p: float = 0.0  # in [0, 1]; 0 disables
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output tokens; 1 disables
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens only
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens only
    seed: int | None = None  # same seed => same output whatever else is in the batch
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: plus the top n
    # the same for each prompt token after the first (vLLM's prompt_logprobs; OpenAI completions echo +
    # logprobs). Such a request reads no prefix-cache pages until they are all computed (scheduler.scheduler)
    prompt_logprobs: int | None = None
    constraint: OutputConstraint | None = None  # the output must match it (constrained decoding)
    # (token id, bias) pairs added to the raw logits before sampling (OpenAI logit_bias), by token id
    logit_bias: tuple[tuple[int, float], ...] = ()
    # False: the request opts out of speculative decoding (the scheduler's --speculative; scheduler.speculation)
    speculative: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(slots=True, frozen=True)
class SamplingLimits:
    """The ranges check_sampling_field holds values to. The defaults are the widest a worker can run."""

    max_tokens: int | None = None  # None: no upper bound (the KV capacity check still applies)
    max_temperature: float = math.inf
    max_repetition_penalty: float = math.inf
    max_abs_penalty: float = math.inf  # presence_penalty and frequency_penalty in [-x, x]
    max_logprobs: int = MAX_LOGPROBS


def check_sampling_field(field: str, value: object, limits: SamplingLimits, prefix: str = "") -> None:
    """Raises InvalidArgument naming prefix + field, the value and its range when value is outside it.
    value may be a raw client value (the type is checked too); None is "unset" and always passes."""
    if value is None:
        return
    name = prefix + field
    if field == "max_tokens":
        check_int_range(name, value, 1, limits.max_tokens)
    elif field == "temperature":
        check_float_range(name, value, 0.0, limits.max_temperature)
    elif field == "top_p":
        check_float_range(name, value, 0.0, 1.0, low_open=True)
    elif field == "top_k":
        check_int_range(name, value, -1, None, note="-1 or 0 disables")
    elif field == "min_p":
        check_float_range(name, value, 0.0, 1.0)
    elif field == "repetition_penalty":
        check_float_range(name, value, 0.0, limits.max_repetition_penalty, low_open=True)
    elif field in ("presence_penalty", "frequency_penalty"):
        check_float_range(name, value, -limits.max_abs_penalty, limits.max_abs_penalty)
    elif field == "seed":
        check_int_range(name, value, *SEED_RANGE)
    elif field in ("logprobs", "prompt_logprobs"):
        check_int_range(name, value, 0, limits.max_logprobs)
    elif field in ("ignore_eos", "speculative"):
        if not isinstance(value, bool):
            raise InvalidArgument(name, value, "must be true or false")
    else:
        raise ValueError(f"check_sampling_field: {field!r} is not a range-checked SamplingParams field")


RANGE_CHECKED_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                        "presence_penalty", "frequency_penalty", "seed", "logprobs", "prompt_logprobs", "ignore_eos",
                        "speculative")


def check_sampling_params(params: SamplingParams, limits: SamplingLimits = SamplingLimits(),
                          prefix: str = "") -> None:
    """Every range-checked field of params (stop_token_ids need the vocabulary: the caller checks them)."""
    for field in RANGE_CHECKED_FIELDS:
        check_sampling_field(field, getattr(params, field), limits, prefix)


def check_int_range(field: str, value: object, low: int, high: int | None, note: str = "") -> None:
    bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
    suffix = f" ({note})" if note else ""
    if not is_int(value):
        raise InvalidArgument(field, value, f"must be an integer {bounds}{suffix}")
    if value < low or (high is not None and value > high):  # type: ignore[operator]
        raise InvalidArgument(field, value, f"must be {'in ' if high is not None else ''}{bounds}{suffix}")


def check_float_range(field: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgument(field, value, f"must be a number in {bounds}")
    if not math.isfinite(value) or value < low or value > high or (low_open and value == low):
        raise InvalidArgument(field, value, f"must be a finite number in {bounds}")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

