"""One state object per request, owned by the scheduler loop.

A request's tokens (the scheduling rule: num_computed_tokens catches up with num_tokens, as in vLLM V1).
A prompt p0..p7 and its output o0 o1 ... over the first steps; "|" is num_computed_tokens (K/V in the
cache), "]" is num_tokens (len(all_token_ids): prompt + output). A step computes the tokens between them,
cut to its budget, and samples one token once it reaches "]"; update() appends that token, so "]" moves
on by one:

    waiting, a prefix-cache hit of 4   p0 p1 p2 p3|p4 p5 p6 p7]             hits count as computed
    after step 1, a chunk of 3         p0 p1 p2 p3 p4 p5 p6|p7]             mid-prompt: sampled nothing
    after step 2, the rest (p7)        p0 p1 p2 p3 p4 p5 p6 p7|o0]          sampled o0
    after step 3, a decode (o0)        p0 p1 p2 p3 p4 p5 p6 p7 o0|o1]       sampled o1: decodes compute 1
    async: step 4 sent, not back yet   p0 p1 p2 p3 p4 p5 p6 p7 o0 o1|??]    ?? = PLACEHOLDER_TOKEN_ID

- async scheduling: a step sent counts as computed at once (Scheduler.assume_done), and a placeholder
  stands for the token it will sample; update_assumed() replaces the oldest first. num_pending_tokens
  counts them, num_known_tokens leaves them out, drop_pending_tokens() forgets them (steps lost).
  A step that verifies drafts is not taken as done: it adds 1 .. k + 1 tokens, known only from its result,
  so the request is `verifying` while it runs and no step is planned past it.
- preemption: recompute moves "|" back to 0 (prompt and output so far run again as one prompt); swap
  keeps it, with the pages waiting in the host tier.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.outputs import FinishReason
from core.requests import GenerationRequest
from core.sampling import SamplingParams
from core.step import PromptLogprobs, TokenLogprobs

if TYPE_CHECKING:
    from scheduler.speculation import SpeculationState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"


# "Finished" is an explicit set, not an ordering of enum values.
FINISHED_STATUSES = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0  # lower runs first (vLLM convention)
    # its API key's latency targets (core.requests.GenerationRequest); None: the scheduler's config
    target_itl_ms: float | None = None
    target_ttft_ms: float | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    # prompt + generated so far; the one list the scheduling rule reads.
    all_token_ids: list[int] = field(default_factory=list)
    # tokens whose K/V are in the cache (prefix hits included). Catches up with num_tokens.
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit of the first scheduling; -1 until then
    num_preemptions: int = 0
    # chained content hashes of the full blocks of all_token_ids (see core.prefix_keys)
    block_hashes: list[bytes] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    trace_context: str = ""  # W3C traceparent of the request's span (plumbing.telemetry); opaque here
    # async scheduling: placeholders (PLACEHOLDER_TOKEN_ID) at the tail of all_token_ids for tokens
    # of steps still in flight; the oldest is replaced first, as results arrive in step order
    num_pending_tokens: int = 0
    # async scheduling with speculation: its drafts are verified in a step in flight, so how many tokens that
    # step adds is unknown until its result; no step plans past it (it sits them out, scheduler.speculation)
    verifying: bool = False
    # SamplingParams.prompt_logprobs: those gathered so far, in position order (entry i: prompt token i + 1)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False  # on the output of the first token
    # speculative decoding (scheduler.speculation): its draft count and its proposer's memory; None until
    # it first speculates, and always without --speculative
    speculation: SpeculationState | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asks for prompt logprobs and some are not computed yet: it may not read prefix-cache pages,
        whose positions would never reach lm_head (and its worker copy must compute them)."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Keeps the entries that extend what is gathered: a chunk recomputed after a preemption repeats
        positions already held, and those are dropped."""
        skip = len(self.prompt_logprobs) + 1 - chunk.first_position
        if 0 <= skip < len(chunk.entries):
            self.prompt_logprobs.extend(chunk.entries[skip:])

    @classmethod
    def from_generation_request(cls, spec: GenerationRequest, trace_context: str = "") -> Request:
        """A fresh WAITING request; its arrival time is now, on this process's monotonic clock."""
        return cls(spec.request_id, list(spec.prompt_token_ids), spec.sampling_params,
                   eos_token_id=spec.eos_token_id, priority=spec.priority, trace_context=trace_context,
                   target_itl_ms=spec.target_itl_ms, target_ttft_ms=spec.target_ttft_ms)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @property
    def num_known_tokens(self) -> int:
        """num_tokens without the placeholders of steps in flight."""
        return len(self.all_token_ids) - self.num_pending_tokens

    def drop_pending_tokens(self) -> None:
        """Forgets the placeholders (their steps' tokens will never be used), and a verification in flight."""
        self.verifying = False
        if self.num_pending_tokens:
            del self.all_token_ids[-self.num_pending_tokens:]
            self.num_pending_tokens = 0
            self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
