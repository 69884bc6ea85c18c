"""What the scheduler hands back for a request after each step: its token deltas, and how it ended."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from core.errors import ServingError
from core.step import TokenLogprobs


class FinishReason(enum.Enum):
    """How a request ended: the one spelling every process uses (the proto enum, Redis records and the
    public APIs' strings are converted from it at their edges)."""

    STOP = "stop"  # an end-of-sequence or stop token (or a stop string at the gateway)
    LENGTH = "length"  # max_tokens or the context length reached
    ABORT = "abort"  # cancelled by its client, or ended unfinished by its deadline (then error is set)
    ERROR = "error"  # failed; error says how


@dataclass(slots=True, frozen=True)
class RequestTimings:
    """Durations a scheduler measured for one request, on its last output (nanoseconds; 0: unknown)."""

    queue_ns: int = 0  # arrival -> first scheduled
    time_to_first_token_ns: int = 0
    decode_ns: int = 0  # first token -> finished
    e2e_ns: int = 0
    first_token_forward_ns: int = 0  # the worker's time for the step that produced the first token


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one entry per prompt token after the first, on the output that
    # carries the first token (None on every other output, and when the request did not ask)
    prompt_logprobs: list[TokenLogprobs] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None  # set when finished
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    # why an unfinished ending happened, by type: DeadlineExceeded, WorkerUnavailable, InvalidArgument, ...
    error: ServingError | None = None
    timings: RequestTimings | None = None  # on the last output of a request, from its scheduler


def coalesce(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output for two consecutive ones of a request (a reader that fell behind): later's, with
    earlier's tokens, logprobs and prompt logprobs in front."""
    later.new_token_ids = earlier.new_token_ids + later.new_token_ids
    later.logprobs = earlier.logprobs + later.logprobs
    if later.prompt_logprobs is None:
        later.prompt_logprobs = earlier.prompt_logprobs
    return later
