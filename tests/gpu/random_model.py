"""Random-weight Llama-family models built straight from a ModelConfig (no loader, no files, no gguf).

The device machine has torch and triton but not every dependency of worker.loader, and an 8B model's
weights are faster to draw on the GPU than to read, so the device script and the GPU-path tests build
their models here.
"""
from __future__ import annotations

import torch

from worker.model.config import ModelConfig
from worker.model.llama import LlamaModel


def llama3_8b_config(max_position_embeddings: int = 2048) -> ModelConfig:
    """Llama-3-8B's shapes; max_position_embeddings bounds the CUDA graphs' block tables, not the model."""
    return ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=False, max_position_embeddings=max_position_embeddings,
        bos_token_id=None, eos_token_id=None)


def tiny_config(num_layers: int = 2, max_position_embeddings: int = 256) -> ModelConfig:
    """GQA ratio 2, head_dim 16: small enough for the Triton interpreter to run a few steps in seconds."""
    return ModelConfig(
        architecture="llama", vocab_size=258, hidden_size=64, intermediate_size=128, num_layers=num_layers,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=False, max_position_embeddings=max_position_embeddings,
        bos_token_id=None, eos_token_id=None)


@torch.no_grad()
def random_llama(config: ModelConfig, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
                 std: float = 0.02) -> LlamaModel:
    """Weights ~ N(0, std), norm weights ~ U(0.5, 1.5), drawn on `device`."""
    if torch.device(device).type == "cpu":  # small models only; the meta context below costs a dynamo import
        model = LlamaModel(config).to(dtype)
    else:
        with torch.device("meta"):
            model = LlamaModel(config)
        model = model.to(dtype).to_empty(device=device)  # cast on meta: an 8B model never exists in float32
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.uniform_(0.5, 1.5, generator=generator)
        else:
            param.normal_(0.0, std, generator=generator)
    return model.eval()
