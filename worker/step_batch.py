"""One step's work as the runner hands it to an execution path: StepBatch, and RequestSpan per request.

A step packs every scheduled request's tokens flat, in plan order, with no padding (invariant 5). Each
row is one token; the lists of row numbers say which rows reach lm_head and which rows' input tokens an
earlier step has not produced yet. Three requests, as an example: A a prefill chunk of 4 prompt tokens
that asks for prompt logprobs and whose chunk ends inside its prompt (no sample), B a decode row whose
token the step before samples (async scheduling), C the last 3 prompt tokens of a prefill that samples:

    row:            0    1    2    3  |  4  |  5    6    7
    request:        A    A    A    A  |  B  |  C    C    C
    input_ids:      p    p    p    p  |  ?  |  p    p    p      ? = PLACEHOLDER_TOKEN_ID until the runner
    positions:      8    9   10   11  | 40  | 13   14   15          fills it, just before forward()
    spans:          [query_start 0, len 4] [4, 1] [5, 3]      (+ context_len, block_table each)

    sample_rows          [4, 7]             R rows: each sampling request's last row, batch order
    prompt_logprob_rows  [0, 1, 2, 3]       Q rows: a row whose next token is a prompt token of a
                                            request asking for prompt logprobs (A's row 3: the token
                                            at position 12, the first of the next chunk)
    placeholder_rows     [4]                P rows: the input an earlier step samples, read from
    placeholder_sources  [(step 6, 1)]      (step id, index among that step's sampled tokens)

    logit_rows = sample_rows + prompt_logprob_rows = [4, 7, 0, 1, 2, 3]
    forward() -> logits [R + Q, vocab]: rows 0..R-1 sample, rows R.. give prompt logprobs

Speculative decoding adds a fourth kind: a request verifying k draft tokens is one span of 1 + k rows (its
last known token, then the drafts), causal among themselves over its pages like a prefill chunk, and every
one of those rows reaches lm_head (verify_rows, after the others: logits [R + Q + sum(1 + k), vocab]).

Only logit_rows reach lm_head: the other prompt rows write their K/V into the pages and stop there.
A leaf module: it imports nothing from the worker, so any room may use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence


@dataclass(slots=True)
class RequestSpan:
    """One request's share of a step: what build_attention_metadata needs."""

    query_start: int  # first row of its tokens in the packed batch
    query_len: int  # tokens computed this step
    context_len: int  # tokens in the cache after this step (prefix + this chunk)
    block_table: Sequence[int]  # its pages, in order; must cover context_len


@dataclass(slots=True)
class StepBatch:
    """One step's scheduled tokens of every request, packed flat in plan order (no padding)."""

    step_id: int
    input_ids: list[int] = field(default_factory=list)  # [T]; placeholder rows filled by the runner before forward()
    positions: list[int] = field(default_factory=list)  # [T]: each token's index in its own sequence
    spans: list[RequestSpan] = field(default_factory=list)  # one per scheduled request, batch order
    sample_rows: list[int] = field(default_factory=list)  # [R]: the last row of each request that samples
    # [Q]: rows whose next token is a prompt token of a request asking for prompt logprobs (only those:
    # other requests' prompt rows never reach lm_head)
    prompt_logprob_rows: list[int] = field(default_factory=list)
    # [S]: every row of the requests that verify draft tokens, in batch order (1 + k per request)
    verify_rows: list[int] = field(default_factory=list)
    placeholder_rows: list[int] = field(default_factory=list)  # [P]: rows whose token an earlier step samples
    # per placeholder row: (step id, index among that step's sampled tokens) it reads; (-1, -1): unknown
    placeholder_sources: list[tuple[int, int]] = field(default_factory=list)

    @property
    def logit_rows(self) -> list[int]:
        """[R + Q + S]: the rows forward() computes logits for: sample rows, prompt-logprob rows, verify rows."""
        if not self.prompt_logprob_rows and not self.verify_rows:
            return self.sample_rows
        return self.sample_rows + self.prompt_logprob_rows + self.verify_rows
