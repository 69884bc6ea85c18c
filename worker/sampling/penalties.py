"""Repetition, presence and frequency penalties (vLLM semantics), applied to raw logits in place.

- repetition (Hugging Face / CTRL): every token seen in the prompt or the output so far has its
  logit divided by the penalty when positive and multiplied by it when negative, so a penalty > 1
  always makes a seen token less likely.
- presence and frequency (OpenAI): over output tokens only; a token generated c times loses
  `frequency_penalty * c + presence_penalty * (c > 0)`.

Repetition goes first, then presence and frequency, as in vLLM's `apply_penalties`.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from core.sampling import SamplingParams


class PenaltyRow(Protocol):
    """What the penalties read from a row (worker.sampling.sampler.SamplingRow has it)."""

    params: SamplingParams
    token_ids: Sequence[int]  # prompt + output so far
    num_prompt_tokens: int


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def apply_penalties(logits: torch.Tensor, rows: Sequence[PenaltyRow]) -> None:
    """logits: [P, V] float32, one row per entry of rows; modified in place.

    Rows whose penalties are neutral (1 / 0 / 0) come out bit-identical: x / 1, x * 1 and x - 0 are
    exact, so vectorizing over a mixed set of rows never changes another row's result.
    """
    num_rows, vocab_size = logits.shape
    if len(rows) != num_rows:
        raise ValueError(f"apply_penalties: logits has {num_rows} rows but rows has {len(rows)}")
    device = logits.device
    output_counts = _token_counts(
        [row.token_ids[row.num_prompt_tokens:] for row in rows], vocab_size, device
    )  # [P, V] int64: how often each token was generated so far

    repetition = [row.params.repetition_penalty for row in rows]
    if any(penalty != 1.0 for penalty in repetition):
        # Only rows that use the repetition penalty pay for counting their prompt.
        prompt_counts = _token_counts(
            [row.token_ids[: row.num_prompt_tokens] if penalty != 1.0 else () for row, penalty in zip(rows, repetition)],
            vocab_size,
            device,
        )  # [P, V]
        seen = (prompt_counts > 0) | (output_counts > 0)  # [P, V] bool
        penalty = torch.tensor(repetition, dtype=logits.dtype, device=device).unsqueeze(1)  # [P, 1]
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits.copy_(torch.where(seen, penalized, logits))

    frequency = [row.params.frequency_penalty for row in rows]
    presence = [row.params.presence_penalty for row in rows]
    if any(frequency) or any(presence):
        frequency_t = torch.tensor(frequency, dtype=logits.dtype, device=device).unsqueeze(1)  # [P, 1]
        presence_t = torch.tensor(presence, dtype=logits.dtype, device=device).unsqueeze(1)  # [P, 1]
        logits.sub_(frequency_t * output_counts + presence_t * (output_counts > 0))


def _token_counts(seqs: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(seqs), vocab_size] int64 counts, built with one bincount over flat (row * V + token) ids.

    The lists go through torch.as_tensor (C speed), not a per-token Python loop: a penalized request
    with a long prompt is rebuilt every step.
    """
    per_row = [torch.as_tensor(seq, dtype=torch.long) for seq in seqs]
    if not any(len(ids) for ids in per_row):
        return torch.zeros(len(seqs), vocab_size, dtype=torch.long, device=device)
    # Checked on the host (no device sync): an out-of-range id would count against the next row.
    for row, ids in enumerate(per_row):
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ValueError(f"apply_penalties: row {row} has token id {bad}, outside vocab size {vocab_size}")
    flat_ids = torch.cat([ids + row * vocab_size for row, ids in enumerate(per_row)]).to(device)  # [total]
    return torch.bincount(flat_ids, minlength=len(seqs) * vocab_size).view(len(seqs), vocab_size)
