"""The CPU path's forward on the compiled decoder ops (worker/csrc/decoder_ops.cpp), over the reference
model's weights (worker.model.llama), which it reads and never switches.

Why: at a few decode rows a step of plain torch was ~5,000 ATen calls (the default model, 30 layers),
each costing more than its arithmetic, and decode attention gathered every request's pages into a
contiguous copy per layer before attending. This forward makes ~11 calls per layer (norms with their
residual add, SwiGLU, q/k norm + RoPE + the cache write each one call) and reads the pages in place.
The plain-torch model stays the reference: tests/worker/paths/test_decoder_ops.py holds each op and the
whole model to it. TorchPath chooses this forward or the model's own once, when it is built.
A mixture-of-experts layer runs the reference's grouped expert matmuls (worker.model.moe) in torch, and
olmoe's whole-projection q/k norms run in torch before the rope op (the op's norms are per head). gpt-oss's
attention sinks go to the decode attention op, which puts each head's in its softmax's max and denominator.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from worker.model.attention import AttentionMetadata, KVScales, paged_attention
from worker.model.kv_cache import KVCache
from worker.model.llama import Attention, DecoderLayer, LlamaModel, MLP, RMSNorm
from worker.model.moe import SparseMoE
from worker.native_ops import cpu_ops_available

log = logging.getLogger(__name__)


def fused_ops_usable(model: LlamaModel) -> bool:
    """Whether the compiled ops can run model (CPU tensors, float32 or bfloat16, the ops built)."""
    dtype = model.norm.weight.dtype  # the model dtype (an embedding may be quantized)
    if not cpu_ops_available():
        return False
    if dtype not in (torch.float32, torch.bfloat16):
        log.warning("compiled decoder ops not used: they run float32 and bfloat16, the model is %s", dtype)
        return False
    return True


def _rms_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.tokenmill.rms_norm(x, norm.weight, norm.eps)


def _attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, attn_metadata: AttentionMetadata, kv_scales: KVScales) -> torch.Tensor:
    """Attention.forward's arithmetic: q/k norms, RoPE and the cache write (quantizing into int8 / float8 pages
    where kv_scales are given) in one call."""
    num_tokens = x.shape[0]
    # the linears' forward, not __call__: nn.Module.__call__ (hook checks) costs microseconds each, eight a
    # layer, and nothing hooks these modules
    qkv = attn.wqkv.forward(x)
    norms = (attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.q_norm is not None else (None, None, 0.0)
    if attn.qk_norm_whole:  # olmoe: norms over the whole projections, which the op's per-head norms are not
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        qkv, norms = torch.cat((attn.q_norm(q), attn.k_norm(k), v), dim=-1), (None, None, 0.0)
    q, k = torch.ops.tokenmill.rope_write_kv(qkv, cos, sin, key_cache, value_cache, attn_metadata.slot_mapping,
                                             attn.num_heads, attn.num_kv_heads, *norms, *(kv_scales or (None, None)))
    v = qkv[:, attn.q_size + attn.kv_size :].view(num_tokens, attn.num_kv_heads, attn.head_dim)
    out = paged_attention(q, k, v, key_cache, value_cache, attn_metadata, attn.scale, attn.window, attn.softcap,
                          kv_scales, attn.sinks)
    return attn.wo.forward(out.view(num_tokens, attn.q_size))


def _mlp(mlp: MLP | SparseMoE, x: torch.Tensor) -> torch.Tensor:
    if isinstance(mlp, SparseMoE):  # a MoE layer: its routing, then its experts (floats, or a GGUF file's blocks)
        return mlp(x)
    return mlp.w_down.forward(torch.ops.tokenmill.act_mul(mlp.w_gate_up.forward(x), mlp.hidden_act == "gelu_tanh"))


def _layer(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
           value_cache: torch.Tensor, attn_metadata: AttentionMetadata, kv_scales: KVScales) -> torch.Tensor:
    """DecoderLayer.forward's arithmetic: the residual join and the MLP's norm in one pass."""
    attn = _attention(layer.attn, _rms_norm(layer.attn_norm, x), cos, sin, key_cache, value_cache, attn_metadata,
                      kv_scales)
    branch = attn if layer.post_attn_norm is None else _rms_norm(layer.post_attn_norm, attn)
    h, normed = torch.ops.tokenmill.add_rms_norm(x, branch, layer.mlp_norm.weight, layer.mlp_norm.eps)
    mlp = _mlp(layer.mlp, normed)
    return h + (mlp if layer.post_mlp_norm is None else _rms_norm(layer.post_mlp_norm, mlp))


class FusedDecoder(nn.Module):
    """LlamaModel.forward on the compiled ops, over model's own modules (a module, so it can be hooked as the
    model can): the final-normed hidden states [T, hidden]."""

    def __init__(self, model: LlamaModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return fused_forward(self.model, input_ids, positions, kv_cache, attn_metadata)


def fused_forward(model: LlamaModel, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                  attn_metadata: AttentionMetadata) -> torch.Tensor:
    """LlamaModel.forward on the compiled ops: the final-normed hidden states [T, hidden]."""
    h = model.embed_input(input_ids)  # [T, hidden]
    tables = model.rotary_tables(positions, h.dtype)
    for layer, key_cache, value_cache, kv_scales, (cos, sin) in zip(
            model.layers, kv_cache.key_caches, kv_cache.value_caches, kv_cache.layer_scales(), tables):
        h = _layer(layer, h, cos, sin, key_cache, value_cache, attn_metadata, kv_scales)
    return _rms_norm(model.norm, h)
