"""The decoder every supported family shares (llama, mistral, qwen2/3, gemma2/3, phi3, and the mixtures of
experts qwen3_moe, mixtral, olmoe, gpt_oss, whose feed-forward is worker.model.moe.SparseMoE) in plain torch,
over one packed token batch. Family details are ModelConfig switches: q/k(/v/o) bias and q/k norms, sliding
windows per layer, attention sinks (gpt-oss), attention and final soft-caps, gemma's sandwich norms, embedding
multiplier and GeLU-tanh, the rope variant (worker.model.rope). Gemma's (1 + w) norms are folded into the weights
at load.

gpt-fast style: small flat modules, q/k/v and gate/up fused into one weight each at load time (one
matmul instead of three / two, which is what matters on CPU). The batch is packed with no padding
(invariant 5): T tokens from many requests, each with its own position; attention reads the paged
KV cache through the step's AttentionMetadata. Weight names follow hf_state_dict_to_fused().

This is the reference, the oracle every faster path is tested against, and nothing switches it: the CPU
path's compiled-op forward (worker.paths.fused_ops) and the Triton forward (worker.paths.triton.forward)
each run the same arithmetic over these modules' weights in their own function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.attention import AttentionMetadata, KVScales, paged_attention, write_kv
from worker.model.config import ModelConfig
from worker.model.kv_cache import KVCache
from worker.model.moe import SparseMoE
from worker.model.rope import rotary_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32 then scale in the model dtype: the order HF uses, so bf16 matches too
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] -> cos, signed_sin: [T, 1, D], angles computed in float32 exactly as HF does.

    HF rotates with x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1). The sign is folded
    into signed_sin = cat(-sin, sin) so apply_rope needs no negation pass.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :]  # [T, 1, D]
    signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :]
    return cos, signed_sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, D]; cos/signed_sin: [T, 1, D]. HF "rotate_half" convention."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # [x2, x1]
    return x * cos + swapped * signed_sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.scale
        self.window = config.window(layer_index)
        self.softcap = config.attn_logit_softcap
        self.wqkv = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.wo = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_out_bias)
        # gpt-oss: one learned logit per query head in every softmax's denominator (worker.model.attention._attend)
        self.sinks = nn.Parameter(torch.empty(config.num_heads)) if config.attention_sinks else None
        # qwen3 / gemma3: one RMSNorm over head_dim, shared by every head, before RoPE;
        # olmoe (qk_norm_whole): one over the whole q projection and one over the whole k projection
        self.qk_norm_whole = config.qk_norm_whole
        q_dim, k_dim = (self.q_size, self.kv_size) if config.qk_norm_whole else (config.head_dim, config.head_dim)
        self.q_norm = RMSNorm(q_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(k_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        value_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        attn_metadata: AttentionMetadata,
        kv_scales: KVScales = None,  # quantized pages' scales (worker.model.kv_quant); None: float pages
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.wqkv(x)  # [T, (H + 2 * KVH) * D]
        if self.qk_norm_whole:  # olmoe: normed over each whole projection, before the split into heads
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)  # [T, H + KVH, D]
        if self.q_norm is not None and not self.qk_norm_whole:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        # q and k sit side by side, so one rotation pass covers both
        qk = apply_rope(qk, cos, sin)  # [T, H + KVH, D]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # q: [T, H, D], k: [T, KVH, D]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)  # v: [T, KVH, D]
        write_kv(key_cache, value_cache, k, v, attn_metadata.slot_mapping, kv_scales)
        out = paged_attention(q, k, v, key_cache, value_cache, attn_metadata, self.scale, self.window, self.softcap,
                              kv_scales, self.sinks)  # [T, H, D]
        return self.wo(out.view(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w_down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.hidden_act = config.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up(x).chunk(2, dim=-1)  # each [T, intermediate]
        if self.hidden_act == "gelu_tanh":  # gemma
            return self.w_down(F.gelu(gate, approximate="tanh") * up)
        return self.w_down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config, layer_index)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # mixtures of experts: the sparse feed-forward on their MoE layers (qwen3_moe may keep dense ones)
        self.mlp = SparseMoE(config) if config.is_moe_layer(layer_index) else MLP(config)
        # gemma2/3: each branch's output is normed again before it joins the residual
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.sandwich_norms else None
        self.post_mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if config.sandwich_norms else None

    def forward(self, x, cos, sin, key_cache, value_cache, attn_metadata, kv_scales: KVScales = None) -> torch.Tensor:
        # x: [T, hidden]; pre-norm residual blocks
        attn = self.attn(self.attn_norm(x), cos, sin, key_cache, value_cache, attn_metadata, kv_scales)
        h = x + (attn if self.post_attn_norm is None else self.post_attn_norm(attn))
        mlp = self.mlp(self.mlp_norm(h))
        return h + (mlp if self.post_mlp_norm is None else self.post_mlp_norm(mlp))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] long, packed over requests
        positions: torch.Tensor,  # [T] long, each token's index in its own sequence
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Returns the final-normed hidden states [T, hidden]; logits come from compute_logits()."""
        h = self.embed_input(input_ids)  # [T, hidden]
        tables = self.rotary_tables(positions, h.dtype)
        for layer, key_cache, value_cache, kv_scales, (cos, sin) in zip(
                self.layers, kv_cache.key_caches, kv_cache.value_caches, kv_cache.layer_scales(), tables):
            h = layer(h, cos, sin, key_cache, value_cache, attn_metadata, kv_scales)
        return self.norm(h)

    def embed_input(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]; gemma scales by sqrt(hidden) rounded to the model dtype, as transformers does."""
        h = self.embed_tokens(input_ids)
        if self.config.embedding_multiplier is not None:
            h = h * torch.tensor(self.config.embedding_multiplier, dtype=h.dtype)
        return h

    def rotary_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, signed_sin) [T, 1, D] per layer; layers sharing a rope variant share one table."""
        config = self.config
        global_tables = rotary_tables(positions, config.head_dim, config.rope_theta, config.rope_scaling,
                                      config.max_position_embeddings, dtype)
        if config.local_rope_theta is None:
            return [global_tables] * config.num_layers
        # gemma3: sliding-window layers use plain RoPE at their own base
        local_tables = rotary_tables(positions, config.head_dim, config.local_rope_theta, None, config.max_position_embeddings, dtype)
        return [global_tables if config.window(i) is None else local_tables for i in range(config.num_layers)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] (only the rows that sample) -> logits [R, vocab] float32."""
        logits = self.lm_head(hidden)
        if self.config.final_logit_softcap is not None:  # gemma2: in the model dtype, as transformers does
            cap = self.config.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
