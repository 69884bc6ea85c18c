"""Speculative decoding, the scheduler's side: who proposes draft tokens, and how many each request gets.

A step with speculation (issue 35) computes, for a decoding request, its one new token plus k draft tokens
a proposer guessed; the worker verifies the drafts against the target model in that same step (one
multi-token row per request: a chunk of 1 + k query tokens over its pages, causal among themselves) and
returns the accepted drafts plus one token of its own (the correction at the first rejection, or the bonus
after the last draft): 1 .. k + 1 tokens a step, the target model's output exactly (greedy: token for
token; sampled: the same distribution, worker.sampling.speculative's rejection sampler).

The seam is Proposer.propose(request, k) -> up to k token ids, called while a step is planned:

    NgramProposer   prompt lookup: the last n tokens (n from max_n down to min_n) matched against the
                    prompt and the output so far; the k tokens that followed their most recent earlier
                    occurrence are the proposal (past the last token it repeats the period the match
                    implies). Pure Python, no model; an index per request, extended as tokens arrive.

    DraftProposer   a draft model (--speculative draft --draft-model PATH): the worker runs it right after a
                    step's verification and sampling (worker.draft_model: it catches the draft's KV up on the
                    tokens just accepted, then takes k greedy steps) and returns its guesses in
                    StepResult.draft_token_ids; propose() reads what the last result left for the request
                    (SpeculationState.worker_drafts) and cuts it to k. The scheduler asks for them in the plan
                    (StepPlan.num_draft_tokens, lookahead()) and allocates that many slots past the step's
                    tokens: the draft writes its K/V for its own guesses there, in the target's pages (the
                    draft's cache shares the target's page ids: worker.draft_model says why that is safe).

A proposer that needs the target's hidden states (EAGLE, MTP) fits DraftProposer's side of the seam as it is:
the worker runs it where it runs the draft model (it holds the hidden states there) and returns proposals the
same way. Nothing else in the loop changes: the k slots, the budget, acceptance and adaptation below are the
same for every kind.

How many drafts (SpeculationState, one per request that speculates): k starts at the server's
--num-speculative-tokens; a step whose drafts were all accepted doubles it (up to that maximum); a
rejection sets it to the number accepted, so a request whose drafts keep failing reaches 0 and stops
paying for verification rows. At 0 it probes again with one draft after a pause that doubles on each
failed probe (PROBE_PAUSE_STEPS .. MAX_PROBE_PAUSE_STEPS steps), and a success resets the pause.

Who speculates (speculates()): a request decoding one token (not mid-prompt) with nothing in flight, that
did not opt out (SamplingParams.speculative: gRPC GenerateParameters.speculative, OpenAI `"speculative":
false`), and whose sampling the verification reproduces exactly: penalties (each row counts the drafts
before it), logprobs (one per emitted token, from the verified rows) and constraints (each row masked at the
grammar's state after the drafts before it) are, and so is a seed: a seeded request's drafts are accepted
while they equal the tokens its sampler draws at their positions (worker.sampling.speculative), so its output
does not depend on how many drafts a step's budget left room for, which depends on the rest of the batch.

Async scheduling (step N + 1 planned while N runs) with the n-gram proposer: a proposal needs the request's last
token, and a verifying step's outcome (how many drafts held) is known only from its result, so step N + 1 is
planned without the requests that cannot be planned past: one verifying drafts in N (Request.verifying), and one
whose token N samples but that would propose next (wants_drafts: its k > 0, or its probe is due). Each sits
N + 1 out and is planned again, with its real tokens, while N + 1 runs. So a batch where every request
speculates runs the synchronous loop (N + 1 would be empty; the driver waits for N), a batch where none does
(an open-ended workload, k adapted to 0) keeps the overlap, and a mix overlaps the rest with the speculating
requests, which then take every other step. A request that sat a step out and then had nothing to propose
pauses as a failed probe would (k = 0): in the synchronous loop an empty proposal costs nothing, here a step. So
a request sits out only when some value of the token in flight could give a proposal (could_propose: for
prompt lookup, its last known token occurs earlier; on the open-ended bench workload at temperature 1 that
cuts the steps sat out by a third to a half, nearly all of which then proposed nothing).
The draft-model proposer keeps the synchronous loop: its guesses ride a step's result and need the tokens that
step sampled.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from core.step import StepResult
from scheduler.config import MAX_SPECULATIVE_TOKENS, SchedulerConfig
from scheduler.request import Request
NGRAM_MAX_N = 4  # prompt lookup tries the last 4 tokens first, ...
NGRAM_MIN_N = 2  # ... then 3, then 2 (a 1-token match proposes too often to pay)
PROBE_PAUSE_STEPS = 8  # a request at k = 0 tries one draft again after this many steps ...
MAX_PROBE_PAUSE_STEPS = 128  # ... doubling after each failed probe, up to this


class Proposer(Protocol):
    # True: the worker computes the proposals (a draft model) and the plan asks it for them (lookahead)
    on_worker: bool

    def propose(self, request: Request, k: int) -> list[int]:
        """Up to k draft tokens to follow request.all_token_ids (all known: no placeholders); [] for none."""

    def could_propose(self, request: Request) -> bool:
        """Async scheduling, a request whose last token is in flight: False only if no value of that token could
        give a proposal (then it need not sit a step out to find out)."""


@dataclass(slots=True)
class NgramIndex:
    """One request's n-gram -> most recent start position, over all_token_ids[:num_indexed + n - 1]'s
    n-grams that end before its last token (so a match always has a token after it). Extended as tokens
    arrive; rebuilt if the tokens ever got shorter."""

    num_indexed: dict[int, int] = field(default_factory=dict)  # n -> n-grams indexed (start positions)
    starts: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> its latest start


class NgramProposer:
    on_worker = False

    def __init__(self, max_n: int = NGRAM_MAX_N, min_n: int = NGRAM_MIN_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, request: Request, k: int) -> list[int]:
        tokens = request.all_token_ids
        state = request.speculation
        index = state.ngrams if state is not None else NgramIndex()
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) <= n:
                continue
            start = self._latest_start(index, tokens, n, len(tokens))
            if start is not None:
                return self._continuation(tokens, start + n, k)
        return []

    def could_propose(self, request: Request) -> bool:
        """An n-gram (n >= min_n) ending at the one token in flight matches only where its first n - 1 tokens, all
        known, occur earlier, ending before the last known token (so that what followed them, the candidate for
        the token in flight, is known too): with no such occurrence no proposal is possible, whatever that token
        is. Several tokens in flight, or 1-token matches, could match anything."""
        if request.num_pending_tokens != 1 or self.min_n < 2:
            return True
        state = request.speculation
        index = state.ngrams if state is not None else NgramIndex()
        return self._latest_start(index, request.all_token_ids, self.min_n - 1, request.num_known_tokens) is not None

    @staticmethod
    def _continuation(tokens: list[int], first: int, k: int) -> list[int]:
        """k tokens from position first on; past the end the proposal reads itself, so a match one period back
        in a repeating text continues the period instead of stopping at the last token."""
        proposal = tokens[first:first + k]
        while len(proposal) < k:
            proposal.append(proposal[first + len(proposal) - len(tokens)])
        return proposal

    @staticmethod
    def _latest_start(index: NgramIndex, tokens: list[int], n: int, end: int) -> int | None:
        """The latest start of tokens[:end]'s last n tokens earlier in tokens[:end] (its match must end before
        the last token)."""
        last_start = end - n  # the suffix itself starts here: earlier starts only
        done = index.num_indexed.get(n, 0)
        if done > last_start:  # the tokens got shorter (never in the loop today): start over
            index.starts = {key: start for key, start in index.starts.items() if len(key) != n}
            done = 0
        for start in range(done, last_start):
            index.starts[tuple(tokens[start:start + n])] = start
        index.num_indexed[n] = last_start
        return index.starts.get(tuple(tokens[last_start:end]))


class DraftProposer:
    """The worker's draft model's guesses (StepResult.draft_token_ids, kept in SpeculationState.worker_drafts),
    while they still follow the request's tokens."""

    on_worker = True

    def propose(self, request: Request, k: int) -> list[int]:
        state = request.speculation
        if state is None or state.worker_drafts_at != request.num_tokens:
            return []  # none yet, or they followed other tokens (a preemption or a stop came between)
        return state.worker_drafts[:k]

    def could_propose(self, request: Request) -> bool:
        return True  # its guesses come with the step's result; its loop is synchronous (wants_drafts)


PROPOSERS = {"ngram": NgramProposer, "draft": DraftProposer}  # SchedulerConfig.speculative -> proposer


@dataclass(slots=True)
class SpeculationState:
    """One request's adaptive draft count and its proposer's memory (Request.speculation)."""

    k: int  # drafts to ask for next step (0: paused)
    ngrams: NgramIndex = field(default_factory=NgramIndex)
    pause: int = PROBE_PAUSE_STEPS  # steps to wait at k = 0 before probing
    waited: int = 0  # steps waited at k = 0 so far
    probing: bool = False  # this step's single draft is a probe
    sat_out: bool = False  # async scheduling: it sat the last step out to propose with its real last token
    worker_drafts: list[int] = field(default_factory=list)  # DraftProposer: the last result's guesses ...
    worker_drafts_at: int = -1  # ... and the num_tokens they follow


def build_speculation(config: SchedulerConfig) -> Speculation | None:
    """The config's speculation (None without one): the one place a method name becomes a proposer."""
    if config.speculative is None:
        return None
    return Speculation(PROPOSERS[config.speculative](), config.num_speculative_tokens)


class Speculation:
    """The scheduler's speculation: a proposer, each request's k, and the counters the metrics read."""

    def __init__(self, proposer: Proposer, num_speculative_tokens: int) -> None:
        if not 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens} must be in 1..{MAX_SPECULATIVE_TOKENS}")
        self.proposer = proposer
        self.max_k = num_speculative_tokens
        self.num_drafts = 0  # steps of a request that verified drafts (vLLM's num_drafts)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * num_speculative_tokens  # drafts accepted at position i

    @staticmethod
    def speculates(request: Request) -> bool:
        params = request.sampling_params
        return params.speculative and not request.num_pending_tokens

    def wants_drafts(self, request: Request) -> bool:
        """Async scheduling: whether a request whose last token is in flight would propose next step (its k > 0,
        or its probe is due); such a request sits the step out rather than decode past that token without drafts
        (which, step after step, would never let it speculate again). Not when no value of that token could give
        a proposal (could_propose): its probe then passes at no cost, and a new request keeps its k until one
        could."""
        if not request.sampling_params.speculative or self.proposer.on_worker:
            return False
        state = self._state(request)
        state.sat_out = (state.k > 0 or state.waited + 1 >= state.pause) and self.proposer.could_propose(request)
        return state.sat_out

    def drafts(self, request: Request, limit: int) -> list[int]:
        """Draft tokens for a request about to decode one token; at most limit (what its budget, max_tokens
        and the model length leave after that token). A decode at k = 0 counts towards its probe, its last
        token known or in flight."""
        if not request.sampling_params.speculative:
            return []
        state = self._state(request)
        sat_out, state.sat_out = state.sat_out, False  # what it sat out for is this call, whatever it returns
        if limit < 1:
            return []
        k = state.k
        if k == 0:
            state.waited += 1
            if state.waited < state.pause:
                return []
            state.waited, state.probing, k = 0, True, 1
        if not self.speculates(request):
            return []
        proposal = self.proposer.propose(request, min(k, limit))
        if not proposal and sat_out:  # the step it sat out bought nothing: pause as a failed probe
            if state.probing:
                state.pause = min(MAX_PROBE_PAUSE_STEPS, 2 * state.pause)
            state.k, state.waited, state.probing = 0, 0, False
        return proposal

    def _state(self, request: Request) -> SpeculationState:
        if request.speculation is None:
            request.speculation = SpeculationState(self.max_k)
        return request.speculation

    def lookahead(self, request: Request) -> int:
        """How many draft tokens the worker proposes for a request about to sample (StepPlan.num_draft_tokens;
        0 for a proposer of the scheduler's own): as many as its k can be after this step's verification
        (a full acceptance doubles it), 1 while it is paused (for the probe)."""
        if not self.proposer.on_worker or not self.speculates(request):
            return 0
        state = request.speculation
        return self.max_k if state is None else min(self.max_k, max(1, 2 * state.k))

    def keep_worker_drafts(self, request: Request, drafts: list[int]) -> None:
        """A step's worker-side proposals for the request, which follow its tokens as they are now."""
        state = self._state(request)
        state.worker_drafts, state.worker_drafts_at = drafts, request.num_tokens

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verified step's outcome for the request: adapts its k and counts it."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
        state = request.speculation
        if state is None:
            return
        if num_accepted == num_drafts:
            state.k = min(self.max_k, max(1, 2 * state.k))
            if state.probing:
                state.pause = PROBE_PAUSE_STEPS
        else:
            state.k = num_accepted
            if state.probing and num_accepted == 0:
                state.pause = min(MAX_PROBE_PAUSE_STEPS, 2 * state.pause)
        state.probing = False

    def stats(self) -> dict[str, object]:
        """The counters, as SchedulerStats' spec_* fields."""
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens,
                "spec_accepted_per_position": tuple(self.accepted_per_position)}


def check_draft_model(speculative: str | None, draft_model: str | None) -> None:
    """ValueError unless a draft model comes exactly with --speculative draft: that method has no proposals
    without one, and a draft model nothing asks would cost every step its catch-up for nothing."""
    if speculative == "draft" and not draft_model:
        raise ValueError("--speculative draft needs a draft model: start the worker with --draft-model PATH (a GGUF "
                         "file or HF folder with the target's tokenizer)")
    if draft_model and speculative != "draft":
        raise ValueError(f"--draft-model {draft_model} is only used with --speculative draft (got --speculative "
                         f"{speculative or 'off'})")


def verified_tokens(request_id: str, drafts: list[int], result: StepResult) -> tuple[list[int], list]:
    """A request's tokens after a step that verified drafts: the accepted drafts, then the worker's own
    token; and their logprobs when it asked (none otherwise). A result that does not fit the drafts sent
    is an error: the scheduler and the worker disagree on the request."""
    accepted = result.accepted_token_ids.get(request_id, [])
    token_id = result.sampled_token_ids.get(request_id)
    if token_id is None or len(accepted) > len(drafts) or accepted != drafts[:len(accepted)]:
        raise ValueError(f"step {result.step_id}: request {request_id!r} verified {drafts} but the "
                         f"worker returned accepted={accepted}, token={token_id}")
    logprobs = result.logprobs.get(request_id)
    return [*accepted, token_id], [*result.accepted_logprobs.get(request_id, []), logprobs] if logprobs else []
