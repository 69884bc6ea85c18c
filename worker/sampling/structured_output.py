"""Constrained decoding on the worker: one grammar matcher per constrained request, beside its tokens.

Where the matcher state lives (DESIGN invariant 1): with the tokens. The scheduler plans steps and
owns pages; the worker already keeps each request's token ids and appends what it samples, so the
matcher is one more piece of the worker's per-request sampling state, like the tokens penalties and
seeds read. It is built when a request arrives in full (new, or resumed after a preemption) by
compiling its constraint (plumbing.grammar, cached by content) and replaying the output tokens it
arrives with: a recomputed request continues from exactly the state it was preempted in, so its
output is the same. No mask crosses the wire, and async scheduling is untouched (the mask of step N+1
is computed after step N's token is appended, on the compute thread, as the penalties are).

Each step the constrained rows' masks are filled by llguidance's thread pool into one [C, W] int32
bitmask (bit t of a row: token t allowed), which the execution path applies before sampling, for
every sampling mode (worker.sampling.sampler on torch; the sampling kernel on Triton).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import llguidance
import torch

from core.sampling import SamplingParams
from plumbing.grammar import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TokenBitmask:
    """Allowed tokens of some rows of a step's logits."""

    rows: list[int]  # [C] row indices into the step's logits, ascending
    bits: torch.Tensor  # [C, W] int32, W = ceil(vocab / 32); bit (t % 32) of word t // 32 allows token t

    def full(self, num_rows: int) -> torch.Tensor:
        """[num_rows, W] int32 on bits' device: -1 (everything allowed) for the unconstrained rows."""
        if len(self.rows) == num_rows:
            return self.bits
        full = torch.full((num_rows, self.bits.shape[1]), -1, dtype=torch.int32, device=self.bits.device)
        full[self.rows] = self.bits
        return full


class StructuredOutput:
    """Builds, advances and reads the matchers of a runner's constrained requests."""

    def __init__(self, compiler: GrammarCompiler, num_threads: int = 2) -> None:
        self.compiler = compiler
        self.executor = llguidance.LLExecutor(num_threads)

    def warm_up(self) -> None:
        """Loads the vocabulary (a fraction of a second) so the first constrained request does not wait.
        A model without a readable vocabulary still serves unconstrained requests: this logs why, and a
        constrained request fails when it arrives, with the same reason."""
        try:
            self.compiler.vocabulary  # noqa: B018 - loads on first access
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("constrained decoding unavailable: no grammar vocabulary from %s (%s: %s)",
                           self.compiler.model_path, type(exc).__name__, exc)

    def new_matcher(self, params: SamplingParams, output_token_ids: Sequence[int]) -> llguidance.LLMatcher | None:
        """A matcher for a request arriving in full, advanced over the output it already has."""
        if params.constraint is None:
            return None
        matcher = self.compiler.matcher(params.constraint)
        for token_id in output_token_ids:
            matcher.consume_token(token_id)
        return matcher

    def bitmask(self, matchers: Sequence[llguidance.LLMatcher | None], device: torch.device) -> TokenBitmask | None:
        """The masks of this step's constrained rows (matchers: one per sampling row, None if unconstrained)."""
        rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return None
        bits = _allocate_bitmask(len(rows), self.compiler.vocabulary.vocab_size)
        self.executor.unsafe_compute_mask_ptr([(matchers[row], index) for index, row in enumerate(rows)],
                                              bits.data_ptr(), bits.shape[1] * 4, len(rows))
        return TokenBitmask(rows, bits.to(device, non_blocking=True))

    def draft_bitmask(self, matcher: llguidance.LLMatcher, drafts: Sequence[int], device: torch.device) -> torch.Tensor:
        """Speculative decoding: [1 + k, W] masks of a constrained request's verified rows, row j at the state after
        its tokens and drafts[:j]. Rows past the first draft the grammar refuses allow everything: verification
        never reaches them (that draft cannot be accepted under its row's mask). The matcher ends where it began."""
        bits = _allocate_bitmask(1 + len(drafts), self.compiler.vocabulary.vocab_size)
        consumed = 0
        for row in range(len(drafts) + 1):
            matcher.unsafe_compute_mask_ptr(bits[row].data_ptr(), bits.shape[1] * 4)
            if row == len(drafts) or matcher.try_consume_tokens([drafts[row]]) != 1:
                break
            consumed += 1
        if consumed:
            matcher.rollback(consumed)
        return bits.to(device, non_blocking=True)

    @staticmethod
    def advance(matchers: Sequence[llguidance.LLMatcher | None], token_ids: Sequence[int]) -> None:
        for matcher, token_id in zip(matchers, token_ids):
            if matcher is not None:
                matcher.consume_token(token_id)


def _allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, W] int32, every bit set, for llguidance to fill through its pointer (llguidance.torch's
    allocate_token_bitmask and fill helpers do the same; that module is not imported: its torch.compile'd function
    pulls torch._dynamo and inductor into every worker, 2.1 s of its start). Pinned where a GPU will take it."""
    shape = (num_rows, (vocab_size + 31) // 32)
    if torch.cuda.is_available():
        try:
            return torch.full(shape, -1, dtype=torch.int32, pin_memory=True)
        except RuntimeError:  # no pinned memory to be had: a plain copy works too, only not overlapped
            pass
    return torch.full(shape, -1, dtype=torch.int32)
