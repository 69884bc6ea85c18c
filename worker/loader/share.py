"""What the loader asks of a share of a model: a tensor-parallel rank's (worker.parallel.shard.HfShare) reads only
the rows or columns it keeps of each Hugging Face tensor, so a rank's host memory holds its share, never the
whole model (N ranks on one machine would otherwise hold N whole models while they load)."""
from __future__ import annotations

from typing import Protocol

import torch

from worker.model.config import ModelConfig


class TensorShare(Protocol):
    def part(self, name: str) -> tuple[int, list[range]] | None:
        """(dim, the ranges along it) of the HF tensor `name` this share keeps, in order; None: all of it."""

    def pad(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The kept part as the share's model holds it (vocabulary rows padded to the same count on every rank)."""

    def rank_config(self) -> ModelConfig:
        """The config of the model the kept parts make."""


def cut(tensor: torch.Tensor, dim: int, ranges: list[range]) -> torch.Tensor:
    """The ranges of `tensor` along dim, concatenated in order."""
    return torch.cat([tensor.narrow(dim, r.start, len(r)) for r in ranges], dim=dim)
