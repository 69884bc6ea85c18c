"""Rank 0's commands to the other ranks of its group (worker.parallel.step_mirror) as one int32 array: no pickle
on the wire, so a peer that reaches a rank's gloo port can make it run a wrong step at worst, never code; and
encoding a 256-row step is a few list copies, not pickling 256 dataclasses. Every value a step holds fits 31 bits
(token and page ids, positions, rows) but step ids, which grow for as long as the server runs: the batch's goes as
two words, and a placeholder's source step as its distance back from it.

    ("runner", num_blocks, num_host_blocks)   [0, num_blocks, num_host_blocks]
    ("swap", swap_out, swap_in)               [1, n, pairs x n (flat), m, pairs x m]
    ("forward", batch)                        [2, step_id // 2^31, step_id % 2^31, T, input_ids, positions, S,
                                               spans, then each row list as its length and items,
                                               placeholder_sources flat as (steps back or -1, index)]
                                              a span: query_start, query_len, context_len, pages, its block table
    ("stop",)                                 [3]
"""
from __future__ import annotations

from array import array

import torch

from worker.step_batch import RequestSpan, StepBatch

KINDS = ("runner", "swap", "forward", "stop")
STEP_WORD = 1 << 31


def encode(command: tuple) -> torch.Tensor:
    kind, *args = command
    words: list[int] = [KINDS.index(kind)]
    if kind == "runner":
        words += [int(args[0]), int(args[1])]
    elif kind == "swap":
        for pairs in args:
            words.append(len(pairs))
            words += [value for pair in pairs for value in pair]
    elif kind == "forward":
        words += _batch_words(args[0])
    return torch.frombuffer(array("i", words), dtype=torch.int32)  # array: ~4x faster than torch.tensor(list)


def _batch_words(batch: StepBatch) -> list[int]:
    words = [*divmod(batch.step_id, STEP_WORD), len(batch.input_ids), *batch.input_ids, *batch.positions,
             len(batch.spans)]
    extend = words.extend
    for span in batch.spans:
        extend((span.query_start, span.query_len, span.context_len, len(span.block_table)))
        extend(span.block_table)
    for rows in (batch.sample_rows, batch.prompt_logprob_rows, batch.verify_rows, batch.placeholder_rows):
        words += [len(rows), *rows]
    words.append(len(batch.placeholder_sources))
    for step, index in batch.placeholder_sources:  # (-1, -1): unknown
        words += [batch.step_id - step if step >= 0 else -1, index]
    return words


def decode(message: torch.Tensor) -> tuple:
    words = _Words(message.numpy().tolist())  # numpy's tolist: ~3x torch's
    kind = KINDS[words.one()]
    if kind == "runner":
        return kind, words.one(), words.one()
    if kind == "swap":
        return kind, words.pairs(), words.pairs()
    if kind == "forward":
        return kind, _batch(words)
    return (kind,)


class _Words:
    """A cursor over the decoded words: slices, not one call a word (a 1,024-row step is ~40k words)."""

    __slots__ = ("values", "at")

    def __init__(self, values: list[int]) -> None:
        self.values, self.at = values, 0

    def one(self) -> int:
        self.at += 1
        return self.values[self.at - 1]

    def take(self, count: int) -> list[int]:
        self.at += count
        return self.values[self.at - count : self.at]

    def counted(self) -> list[int]:
        return self.take(self.one())

    def pairs(self) -> list[tuple[int, int]]:
        flat = self.take(2 * self.one())
        return list(zip(flat[::2], flat[1::2]))


def _batch(words: _Words) -> StepBatch:
    step_id = words.one() * STEP_WORD + words.one()
    tokens = words.one()
    batch = StepBatch(step_id, words.take(tokens), words.take(tokens))
    spans, one, take = batch.spans, words.one, words.take
    for _ in range(one()):
        query_start, query_len, context_len, pages = take(4)
        spans.append(RequestSpan(query_start, query_len, context_len, take(pages)))
    batch.sample_rows, batch.prompt_logprob_rows = words.counted(), words.counted()
    batch.verify_rows, batch.placeholder_rows = words.counted(), words.counted()
    batch.placeholder_sources = [(step_id - back if back >= 0 else -1, index) for back, index in words.pairs()]
    return batch
