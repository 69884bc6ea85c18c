"""The Triton backend's forward pass: the same weights as worker.model.llama.LlamaModel, every layer through kernels.

Per layer: fused residual-add + RMSNorm, the fused q/k/v matmul, rotary on q and k, write_kv into the
pages, paged attention, the output matmul, fused add + RMSNorm, gate/up matmul, SiLU·mul, down matmul; a
mixture-of-experts layer (qwen3_moe, mixtral, olmoe, gpt_oss) routes in torch as the reference does
(worker.model.moe.route) and runs its stacked float experts through the fused-MoE kernel (two grouped-GEMM launches
over every expert; gpt-oss's biases in their epilogues, its clamped SwiGLU between them). The family switches ride
along: sliding windows, soft-caps and sinks in the attention kernels, the sandwich
norms (gemma), the per-head q/k norms (qwen3, gemma3) and the whole-projection ones (olmoe) as rms_norm
kernels, and beside the kernels in torch (elementwise or per row): GeLU-tanh (gemma), the embedding multiplier
and the rope variant's tables (the model's own embed_input / rotary_tables, so both paths share them).
Attention is one launch per layer whatever the batch holds: the decode kernel when every row has one
query token (the case CUDA graphs capture), otherwise the prefill kernel, which also takes the
query_len == 1 rows of a mixed batch. Metadata is a few flat int tensors, so a decode step's metadata
can live in static buffers that a CUDA graph reads (worker.paths.triton.cuda_graphs).

Kernel modules are imported on first use, never at import time: TRITON_INTERPRET must be set before
that on a machine without CUDA, and the torch backend never needs them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from worker.model.attention import span_slots
from worker.model.kv_cache import KVCache
from worker.model.llama import MLP, LlamaModel
from worker.model.moe import SparseMoE, StackedExperts, route, run_grouped
from worker.step_batch import RequestSpan


@dataclass(slots=True)
class KernelMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset per token; < 0 skips the write
    block_tables: torch.Tensor  # [R, max_blocks] int32, padded with block 0 past each context
    query_start_loc: torch.Tensor  # [R + 1] int32: row r's tokens are [loc[r], loc[r + 1])
    context_lens: torch.Tensor  # [R] int32: prefix + this step's tokens, K/V written before attention
    decode_only: bool  # every row has one query token (T == R): the decode kernel runs


@dataclass(slots=True)
class HostMetadata:
    """The same facts as KernelMetadata as host lists, before they are copied to the device."""

    slot_mapping: list[int]
    block_tables: list[list[int]]
    query_start_loc: list[int]
    context_lens: list[int]
    decode_only: bool


def host_metadata(spans: Sequence[RequestSpan], block_size: int) -> HostMetadata:
    """spans in packed-batch order; raises ValueError if a block table cannot hold its context."""
    slot_mapping: list[int] = []
    tables: list[list[int]] = []
    starts = [0]
    for span in spans:
        num_blocks, slots = span_slots(span, block_size)
        slot_mapping.extend(slots)
        tables.append(list(span.block_table[:num_blocks]))
        starts.append(starts[-1] + span.query_len)
    max_blocks = max((len(table) for table in tables), default=1)
    padded = [table + [0] * (max_blocks - len(table)) for table in tables]
    return HostMetadata(slot_mapping, padded, starts, [span.context_len for span in spans],
                        all(span.query_len == 1 for span in spans))


def to_device(host: HostMetadata, device: torch.device | str) -> KernelMetadata:
    return KernelMetadata(
        slot_mapping=torch.tensor(host.slot_mapping, dtype=torch.int64, device=device),
        block_tables=torch.tensor(host.block_tables, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(host.query_start_loc, dtype=torch.int32, device=device),
        context_lens=torch.tensor(host.context_lens, dtype=torch.int32, device=device),
        decode_only=host.decode_only,
    )


def build_kernel_metadata(spans: Sequence[RequestSpan], block_size: int, device: torch.device | str) -> KernelMetadata:
    return to_device(host_metadata(spans, block_size), device)


@dataclass(frozen=True, slots=True)
class TritonKernels:
    """The Triton kernels one forward pass and the device-side sampling call (worker/kernels), imported
    when a TritonPath is built, not when this module is: Triton compiles on first use."""

    silu_and_mul: Callable[..., torch.Tensor]
    write_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    paged_prefill_attention: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rms_norm: Callable[..., torch.Tensor]
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    sample_tokens: Callable[..., torch.Tensor]
    fused_moe: Callable[..., torch.Tensor]


def load_kernels() -> TritonKernels:
    from worker.kernels.activation import silu_and_mul
    from worker.kernels.fused_moe import fused_moe
    from worker.kernels.kv_write import write_kv
    from worker.kernels.paged_decode_attention import paged_decode_attention
    from worker.kernels.prefill_attention import paged_prefill_attention
    from worker.kernels.rms_norm import fused_add_rms_norm, rms_norm
    from worker.kernels.rotary import apply_rotary
    from worker.kernels.sampling import sample_tokens

    return TritonKernels(
        silu_and_mul=silu_and_mul, write_kv=write_kv, paged_decode_attention=paged_decode_attention,
        paged_prefill_attention=paged_prefill_attention, fused_add_rms_norm=fused_add_rms_norm,
        rms_norm=rms_norm, apply_rotary=apply_rotary, sample_tokens=sample_tokens, fused_moe=fused_moe,
    )


def _head_norm(kernels: TritonKernels, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """qwen3 / gemma3's q or k norm, x: [T, heads, D] (a view into qkv) -> a new [T, heads, D]: one program per
    head vector, so a token's norm never depends on the step's other rows."""
    num_tokens, num_heads, head_dim = x.shape
    return kernels.rms_norm(x.reshape(-1, head_dim), norm.weight, norm.eps).view(num_tokens, num_heads, head_dim)


def _whole_norm(kernels: TritonKernels, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """olmoe's q or k norm over the whole projection, x: [T, heads, D] (a view into qkv) -> a new [T, heads, D]: one
    program per token's [heads * D] row."""
    num_tokens, num_heads, head_dim = x.shape
    return kernels.rms_norm(x.reshape(num_tokens, num_heads * head_dim), norm.weight, norm.eps).view(
        num_tokens, num_heads, head_dim)


def _inner(branch: torch.nn.Module) -> tuple[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """(the attention or MLP module, what its output goes through): a tensor-parallel SumOverRanks' inner module
    and its group's all-reduce (found by its attributes: the paths and worker.parallel import neither other), else the module
    itself and nothing."""
    group = getattr(branch, "group", None)
    return (branch.inner, group.all_reduce) if group is not None else (branch, _unchanged)


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


def _mlp(kernels: TritonKernels, mlp: MLP, x: torch.Tensor) -> torch.Tensor:
    gate, up = mlp.w_gate_up(x).chunk(2, dim=-1)  # each [T, intermediate]
    if mlp.hidden_act == "gelu_tanh":
        return mlp.w_down(torch.nn.functional.gelu(gate, approximate="tanh") * up)
    return mlp.w_down(kernels.silu_and_mul(gate, up))


def _sparse_moe(kernels: TritonKernels, moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """x: [T, H] -> [T, H]. The routing is the reference's own call (same top-k, same ties); stacked float experts
    run in the fused kernel, any other experts behind SparseMoE's seam (a GGUF file's blocks under the CPU's
    --cpu-block-kernels: their own native kernels) as the reference runs them."""
    top_weights, top_experts = route(x, moe.router_weight, moe.top_k, moe.norm_topk_prob, moe.weights_float,
                                     moe.router_bias, moe.topk_first)
    experts = moe.experts
    if isinstance(experts, StackedExperts):  # gpt-oss: its biases and clamped SwiGLU ride along (None elsewhere)
        return kernels.fused_moe(x, top_weights, top_experts, experts.gate_up, experts.down, experts.hidden_act,
                                 gate_up_bias=experts.gate_up_bias, down_bias=experts.down_bias, swiglu=experts.swiglu)
    return run_grouped(x, top_weights, top_experts, moe.num_experts, experts)


def triton_forward(
    model: LlamaModel,
    input_ids: torch.Tensor,  # [T] long, packed over requests
    positions: torch.Tensor,  # [T] long
    kv_cache: KVCache,
    metadata: KernelMetadata,
    kernels: TritonKernels,
) -> torch.Tensor:
    """Returns the final-normed hidden states [T, hidden], like LlamaModel.forward."""
    num_tokens = input_ids.shape[0]
    h = model.embed_input(input_ids)  # [T, hidden] (a tensor-parallel share: its rows, all-reduced)
    tables = model.rotary_tables(positions, h.dtype)  # per layer: cos, sin [T, 1, D]
    residual = None
    for layer, key_cache, value_cache, kv_scales, (cos, sin) in zip(
            model.layers, kv_cache.key_caches, kv_cache.value_caches, kv_cache.layer_scales(), tables):
        if residual is None:  # the first layer has no residual yet: plain norm, the input is the residual
            x, residual = kernels.rms_norm(h, layer.attn_norm.weight, layer.attn_norm.eps), h
        else:
            x, residual = kernels.fused_add_rms_norm(h, residual, layer.attn_norm.weight, layer.attn_norm.eps)
        # a tensor-parallel share (worker.parallel) wraps the branches in SumOverRanks: the rank's heads and
        # columns (the module's own sizes, not the whole model's config), each branch's output all-reduced
        attn, attn_sum = _inner(layer.attn)
        num_heads, num_kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        q_size, kv_size = attn.q_size, attn.kv_size
        qkv = attn.wqkv(x)  # [T, (H + 2 * KVH) * D]
        q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_dim)
        if attn.q_norm is not None:  # per-head norms: the rms_norm kernel over [T * heads, D] rows
            norm = _whole_norm if attn.qk_norm_whole else _head_norm
            q, k = norm(kernels, attn.q_norm, q), norm(kernels, attn.k_norm, k)
        q, k = kernels.apply_rotary(q, k, cos, sin)
        kernels.write_kv(k, v, key_cache, value_cache, metadata.slot_mapping, kv_scales)  # quantized: with scales
        # int8 / float8 pages: dequantized as the kernels read them (a prefill reads its own keys back too)
        attend = dict(window=attn.window, softcap=attn.softcap, kv_scales=kv_scales, sinks=attn.sinks)
        if metadata.decode_only:
            out = kernels.paged_decode_attention(q, key_cache, value_cache, metadata.block_tables,
                                                 metadata.context_lens, attn.scale, **attend)  # [T, H, D]
        else:
            out = kernels.paged_prefill_attention(q, key_cache, value_cache, metadata.block_tables,
                                                  metadata.query_start_loc, metadata.context_lens, attn.scale, **attend)
        h = attn_sum(attn.wo(out.reshape(num_tokens, q_size)))
        if layer.post_attn_norm is not None:  # gemma: the branch output is normed before the residual add
            h = kernels.rms_norm(h, layer.post_attn_norm.weight, layer.post_attn_norm.eps)
        x, residual = kernels.fused_add_rms_norm(h, residual, layer.mlp_norm.weight, layer.mlp_norm.eps)
        mlp, mlp_sum = _inner(layer.mlp)
        h = mlp_sum(_sparse_moe(kernels, mlp, x) if isinstance(mlp, SparseMoE) else _mlp(kernels, mlp, x))
        if layer.post_mlp_norm is not None:
            h = kernels.rms_norm(h, layer.post_mlp_norm.weight, layer.post_mlp_norm.eps)
    normed, _ = kernels.fused_add_rms_norm(h, residual, model.norm.weight, model.norm.eps)
    return normed
