"""Rotary position tables for every RoPE variant the supported families use, exact to transformers.

inverse_frequencies() follows transformers' modeling_rope_utils per type (linear, dynamic NTK, llama3,
yarn, longrope); rotary_tables() turns positions into the cos / signed-sin tables model.apply_rope and
the Triton rotary kernel take.

Two types depend on the sequence length in transformers (dynamic NTK grows its base past the
original length; longrope switches from short to long factors past it), and there the whole sequence
of a forward call uses the length of its longest position. Over a paged cache that would re-rotate
keys already written, so here each token uses its own length (position + 1): identical to
transformers up to the original length, and to its token-by-token decoding past it.
"""
from __future__ import annotations

import functools
import math

import torch

from worker.model.config import RopeScaling


def _default_inv_freq(theta: float, dim: int, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))  # [D/2]


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / scaling.low_freq_factor
    high_freq_wavelen = old_context_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, scaling: RopeScaling, device) -> tuple[torch.Tensor, float]:
    factor = scaling.factor
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(scaling.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


def _longrope_attention_factor(scaling: RopeScaling) -> float:
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = scaling.factor
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(scaling.original_max_position_embeddings))


@functools.lru_cache(maxsize=64)
def _factor_tensor(factors: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A per-frequency factor list on the device, made once: the first (eager) forward creates it, so a
    CUDA graph captured later replays with no host-to-device copy inside it."""
    return torch.tensor(factors, dtype=torch.float32, device=device)


def rotary_tables(
    positions: torch.Tensor,  # [T] long
    head_dim: int,
    theta: float,
    scaling: RopeScaling | None,
    max_position_embeddings: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> cos, signed_sin: [T, 1, D] (signed_sin = cat(-sin, sin), HF's rotate_half sign folded in)."""
    device = positions.device
    pos = positions.float()[:, None]  # [T, 1]
    attention_factor = 1.0
    rope_type = "default" if scaling is None else scaling.rope_type
    inv_freq = _default_inv_freq(theta, head_dim, device)  # [D/2]
    if rope_type == "linear":
        freqs = pos * (inv_freq / scaling.factor)[None, :]
    elif rope_type == "freq_factors":
        freqs = pos * (inv_freq / _factor_tensor(scaling.freq_factors, device))[None, :]
    elif rope_type == "llama3":
        freqs = pos * _llama3(inv_freq, scaling)[None, :]
    elif rope_type == "yarn":
        yarn_freq, attention_factor = _yarn(theta, head_dim, scaling, device)
        freqs = pos * yarn_freq[None, :]
    elif rope_type == "dynamic":
        # per token: base * (factor * len / max - (factor - 1)) ** (D / (D - 2)), len >= max
        seq_len = torch.clamp(pos + 1, min=max_position_embeddings)  # [T, 1]
        base = theta * ((scaling.factor * seq_len / max_position_embeddings) - (scaling.factor - 1)) ** (head_dim / (head_dim - 2))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim  # [D/2]
        freqs = pos * (1.0 / (base ** exponents[None, :]))
    elif rope_type == "longrope":
        attention_factor = _longrope_attention_factor(scaling)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
        short = 1.0 / (_factor_tensor(scaling.short_factor, device) * theta**exponents)
        long = 1.0 / (_factor_tensor(scaling.long_factor, device) * theta**exponents)
        beyond = (pos + 1) > scaling.original_max_position_embeddings  # [T, 1]
        freqs = pos * torch.where(beyond, long[None, :], short[None, :])
    else:
        freqs = pos * inv_freq[None, :]  # [T, D/2]
    cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
    cos = torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :]  # [T, 1, D]
    signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]
    return cos, signed_sin
