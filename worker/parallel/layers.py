"""What a rank's share of the model swaps in around the plain reference modules (which stay unchanged:
worker.model is the oracle, and TP=1 is exactly it).

    SumOverRanks(attn)      the rank's heads' share of o_proj's output  -> all-reduce -> the layer's
    SumOverRanks(mlp)       the rank's columns' share of down's output    -> all-reduce    full output
    VocabParallelEmbedding  the rank's vocabulary rows; other ids give 0  -> all-reduce -> embeddings
    GatheredLMHead          the rank's vocabulary columns of the logits   -> all-gather -> [R, vocab]

A split contraction gives each rank a partial sum, so o and down need no bias split (neither has one) and
the sum is exact up to float order: logits within 1e-4 of one rank in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.parallel.group import TensorParallelGroup


class SumOverRanks(nn.Module):
    def __init__(self, inner: nn.Module, group: TensorParallelGroup) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    def forward(self, *args) -> torch.Tensor:
        return self.group.all_reduce(self.inner(*args))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the vocabulary's embeddings (the last rank's padded with zeros)."""

    def __init__(self, weight: nn.Parameter, start: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = weight  # [rows, hidden]
        self.start = start
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(h.masked_fill(outside[:, None], 0))


class GatheredLMHead(nn.Module):
    """The rank's vocabulary columns of the logits, gathered: [R, hidden] -> [R, vocab_size]."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = weight  # [rows, hidden], padded to the same rows on every rank
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(F.linear(hidden, self.weight))[:, : self.vocab_size]
