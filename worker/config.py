"""The model facts the worker needs, read from GGUF metadata or a Hugging Face config.json."""
from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    architecture: str  # one of SUPPORTED_ARCHITECTURES; all three share one forward pass
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # MLP inner width (gate/up output)
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # K/V heads (GQA: num_heads is a multiple of it)
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool  # lm_head reuses the input embedding
    attention_bias: bool  # q/k/v projections carry a bias (qwen2)
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {self.architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim
