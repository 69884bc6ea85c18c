"""Sampling (placeholder: greedy only; the sampler helper replaces this file, keeping the interface)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from scheduler.plan import TokenLogprobs
from scheduler.request import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    token_ids: Sequence[int]  # prompt + output so far (the worker's own copy)
    num_prompt_tokens: int


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [B, V] float32, one row per request that samples this step, in the order of rows."""
    token_ids = logits.argmax(dim=-1).tolist()
    return token_ids, [None] * len(token_ids)
