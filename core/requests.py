"""A generation request as the gateway hands it to a scheduler: immutable, validated, tokenized.

The scheduler builds its own mutable state object (scheduler.request.Request) from it; nothing outside
the scheduler ever holds that one.
"""
from __future__ import annotations

from dataclasses import dataclass

from core.sampling import SamplingParams


@dataclass(slots=True, frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]  # read-only by convention (a list: it goes straight into protobuf and tokenizers)
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    priority: int = 0  # lower runs first (vLLM convention)
    # latency targets of the submitting API key's class of service (gateway.access.api_keys), milliseconds;
    # None: the scheduler's --target-itl-ms / --target-ttft-ms apply
    target_itl_ms: float | None = None
    target_ttft_ms: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
