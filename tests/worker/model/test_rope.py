"""worker.model.rope against transformers' rotary embeddings, type by type, past the original lengths too.

The parity tests cover the types through whole models at test lengths; here the tables themselves
are compared over positions well past original_max_position_embeddings, where llama3 / yarn /
dynamic / longrope differ from plain RoPE the most. For the two length-dependent types transformers
rotates a whole forward call at its longest length: our per-token tables must equal its last row.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_models import tiny_hf_config
from worker.loader.hf_loader import parse_hf_config
from worker.model.rope import rotary_tables


def _ours_and_config(flavour: str):
    hf_config = tiny_hf_config(flavour)
    raw = hf_config.to_dict() | {"architectures": [type(hf_config).__name__.replace("Config", "ForCausalLM")]}
    config = parse_hf_config(raw, Path("config.json"), tie_word_embeddings=True)
    return hf_config, config


def _hf_rotary(flavour: str, hf_config):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    return (Phi3RotaryEmbedding if flavour == "phi3" else LlamaRotaryEmbedding)(hf_config)


@pytest.mark.parametrize("flavour", ["llama3_rope", "llama_linear_rope", "llama_yarn_rope"])
def test_static_scaled_tables_equal_transformers_past_the_original_length(flavour):
    hf_config, config = _ours_and_config(flavour)
    positions = torch.arange(400)
    cos, sin = rotary_tables(positions, config.head_dim, config.rope_theta, config.rope_scaling,
                             config.max_position_embeddings, torch.float32)
    x = torch.zeros(1, 400, config.head_dim)
    hf_cos, hf_sin = _hf_rotary(flavour, hf_config)(x, positions[None])
    half = config.head_dim // 2
    torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[:, 0, half:], hf_sin[0, :, half:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("flavour, length", [("llama_dynamic_rope", 700), ("llama_dynamic_rope", 1500), ("phi3", 300), ("phi3", 100)])
def test_length_dependent_tables_equal_transformers_at_the_last_position(flavour, length):
    hf_config, config = _ours_and_config(flavour)
    assert config.rope_scaling.rope_type in ("dynamic", "longrope")
    positions = torch.arange(length)
    cos, sin = rotary_tables(positions, config.head_dim, config.rope_theta, config.rope_scaling,
                             config.max_position_embeddings, torch.float32)
    hf_cos, hf_sin = _hf_rotary(flavour, hf_config)(torch.zeros(1, length, config.head_dim), positions[None])
    torch.testing.assert_close(cos[-1, 0], hf_cos[0, -1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[-1, 0, config.head_dim // 2 :], hf_sin[0, -1, config.head_dim // 2 :], rtol=1e-5, atol=1e-5)
    # and the scaling did something there: plain RoPE differs
    plain, _ = rotary_tables(positions, config.head_dim, config.rope_theta, None, config.max_position_embeddings, torch.float32)
    assert not torch.allclose(plain[-1], cos[-1], atol=1e-3)


def test_gpt_oss_untruncated_yarn_equals_transformers():
    """gpt-oss's YaRN (truncate false: the ramp's ends not rounded) against GptOssRotaryEmbedding, whose tables hold
    each frequency once ([.., D/2]) where ours repeat them for the rotate_half layout."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    hf_config = tiny_hf_config("gpt_oss")
    config = parse_hf_config(hf_config.to_dict(), Path("config.json"), tie_word_embeddings=False)
    assert config.rope_scaling.rope_type == "yarn" and not config.rope_scaling.truncate
    positions = torch.arange(400)
    cos, sin = rotary_tables(positions, config.head_dim, config.rope_theta, config.rope_scaling,
                             config.max_position_embeddings, torch.float32)
    hf_cos, hf_sin = GptOssRotaryEmbedding(hf_config)(torch.zeros(1, 400, config.head_dim), positions[None])
    half = config.head_dim // 2
    torch.testing.assert_close(cos[:, 0, :half], hf_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin[:, 0, half:], hf_sin[0], rtol=1e-6, atol=1e-6)
    truncated = replace(config.rope_scaling, truncate=True)  # and the flag matters at these sizes
    rounded, _ = rotary_tables(positions, config.head_dim, config.rope_theta, truncated,
                               config.max_position_embeddings, torch.float32)
    assert not torch.allclose(rounded, cos, atol=1e-4)
