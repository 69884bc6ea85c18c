"""The step messages between scheduler and worker (invariant 1: the scheduler owns the pages).

A plan sends a request in full the first time it is scheduled (and again when it resumes after a
preemption); after that only diffs: new pages and the computed count. The worker keeps its own copy
of each request's token ids and appends the tokens it samples, so running requests never resend them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from core.sampling import SamplingParams

# Async scheduling: the scheduler's stand-in for a token its worker has sampled but not yet returned.
# It never leaves the scheduler: the worker appends the tokens it samples to its own copy of each
# request, so a decode row that follows an in-flight step is packed from the worker's real token.
PLACEHOLDER_TOKEN_ID = -1

# A page a sliding-window request gave back (scheduler.pages.kv_manager: every position in it lies before the
# window of all its later tokens). It keeps its place in the block table, so the pages after it keep
# their indices, and no attention reads it: the windowed Triton kernels start at the window, the torch
# gather masks it. Any valid page id would do; page 0 always exists. The worker's copy of a running
# request keeps the old id instead (never told): that page may hold another request's K/V by then, unread.
FREED_BLOCK_ID = 0


@dataclass(slots=True)
class NewRequestData:
    request_id: str
    token_ids: list[int]  # prompt + any output generated before a preemption
    num_prompt_tokens: int  # token_ids[:num_prompt_tokens] is the prompt (penalties need the split)
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table so far (pages given back are FREED_BLOCK_ID)
    num_computed_tokens: int  # already in the cache (prefix-cache hit), 0 otherwise
    trace_context: str = ""  # the request's W3C traceparent, opaque here; worker step spans link to it


@dataclass(slots=True)
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]  # appended to the worker's block table
    num_computed_tokens: int  # before this step; lets the worker check it agrees
    # pages dropped from the end of the worker's block table before new_block_ids are appended: the tail
    # that only rejected draft tokens had written (speculative decoding gave them back)
    num_dropped_block_ids: int = 0


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # request id -> tokens to compute this step. Insertion order is the packed batch order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # the worker drops its state for these before running the step (finished, aborted, preempted)
    finished_request_ids: list[str] = field(default_factory=list)
    # page copies the worker makes before the step's forward pass, swap_out first, then swap_in:
    # (device block id, host block id) pairs, device -> host and host -> device. An empty plan is
    # never sent, so the scheduler keeps the copies of one for the next plan (still before any step
    # that could write those device pages)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # speculative decoding: request id -> the draft tokens it verifies this step. They follow its known
    # tokens, and num_scheduled_tokens counts them (a decode with k drafts computes 1 + k rows)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # draft-model speculation (--speculative draft): request id -> how many draft tokens the worker's draft
    # model proposes for it right after this step (StepResult.draft_token_ids). The scheduler allocated
    # that many slots past the step's tokens, where the draft's own K/V for its guesses lands
    num_draft_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(slots=True)
class TokenLogprobs:
    logprob: float  # of the chosen token, from the model's raw distribution
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass(slots=True)
class PromptLogprobs:
    """One step's logprobs of a request's prompt tokens (SamplingParams.prompt_logprobs): entries[i] is
    the prompt token at position first_position + i, as predicted by the row before it. A prefill chunk
    over positions [s, e) gives those of the tokens s+1 .. min(e, num_prompt_tokens - 1)."""

    first_position: int
    entries: list[TokenLogprobs] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    step_id: int
    # one entry per request whose computed count reached its token count this step (the others
    # were mid-prefill chunks and sample nothing)
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # speculative decoding: per request that verified drafts, those accepted (a prefix of its drafts, maybe
    # empty); its step's tokens are these, then sampled_token_ids' (the correction or the bonus token)
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # ... and, for those asking for logprobs, one TokenLogprobs per accepted token (logprobs holds the last one's)
    accepted_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    forward_ns: int = 0
    # the prompt tokens this step's rows predict, for requests that ask for prompt logprobs (any chunk)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # draft-model speculation: per request the plan's num_draft_tokens named, the draft model's greedy guesses
    # of the tokens after this step's (after its last sampled token); fewer than asked when its pages ran out
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
