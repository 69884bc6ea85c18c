"""What the three front doors serve, the same for each (gateway.main builds it once)."""
from __future__ import annotations

from dataclasses import dataclass

from gateway.generation.generations import Generations
from gateway.prepare.validation import Limits
from gateway.text.tokenizer import TextTokenizer
from protos.tokenmill.v1 import common_pb2


@dataclass(frozen=True, slots=True)
class ServedModel:
    # the one route choice, and the tokenizer, scheduler target and Redis side it holds
    generations: Generations
    info: common_pb2.GetModelInfoResponse  # the model the scheduler reports
    limits: Limits  # the requests it takes (context length, vocabulary, max_tokens)

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.generations.tokenizer

    @property
    def name(self) -> str:
        return self.info.model_config.name
