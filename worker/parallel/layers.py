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
    """Rows [start, start + rows) of the vocabulary's embeddings: `local` looks them up (an nn.Embedding, or a
    quantized embedding on the rank's rows of the file: worker.parallel.shard_weights); other ids give 0."""

    def __init__(self, local: nn.Module, start: int, rows: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.local = local
        self.start, self.rows = start, rows
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        h = self.local(local.masked_fill(outside, 0))
        return self.group.all_reduce(h.masked_fill(outside[:, None], 0))


class GatheredLMHead(nn.Module):
    """The rank's vocabulary columns of the logits, gathered: [R, hidden] -> [R, vocab_size]. `local`: a linear
    over the rank's rows, padded to the same count on every rank (float or quantized)."""

    def __init__(self, local: nn.Module, vocab_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.local = local
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(self.local(hidden))[:, : self.vocab_size]
