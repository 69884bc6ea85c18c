"""The sparse mixture-of-experts feed-forward (qwen3_moe, mixtral, olmoe, gpt_oss) in plain torch: the reference.

Routing is transformers' (Qwen3MoeTopKRouter, MixtralTopKRouter, OlmoeTopKRouter): router logits, a softmax
in float32 over every expert, torch.topk, then (norm_topk_prob; Mixtral always) the k weights renormalised to
sum to 1. Mixtral's "top-k logits, then softmax over them" is the same numbers: the renormalised softmax.
gpt-oss (GptOssTopKRouter) is routed in its own order, since its logits carry a bias and a softmax over every
expert can round two far-apart small logits to the same probability: torch.topk over the raw logits, then a
softmax over the k chosen, in the model dtype. Its experts (GptOssExperts) carry biases and a clamped SwiGLU,
(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g) with g = min(gate, l); transformers stores gate and up interleaved
(columns 0, 2, 4, ... gate), the loader de-interleaves them into this file's layout (worker.loader.weights).

Execution groups the step's tokens by expert, never loops over tokens:

    top_k_index [T, K] -> T*K (token, expert) pairs, sorted by expert (stable: token order kept)
    pairs:   | e0 e0 e0 | e2 | e3 e3 |        counts per expert (e1: 0 tokens, never touched)
    rows:    x[token of each pair]  -> [T*K, H]
    each expert with tokens: gate/up once over its rows, act * up, down   -> [n_e, H]
    out.index_add_(token of each pair, expert rows * routing weight)      -> [T, H]

The experts' weights are stacked parameters (StackedExperts: [E, 2I, H] gate rows then up rows, [E, H, I]), not
nn.Linear, so no path's linear swap (packing, int8/int4, batch-invariant tiles) touches them; they run in the model
dtype. A GGUF file's experts may instead stay in its blocks (worker.linears.ggml_experts), behind the same seam.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from worker.model.config import ModelConfig


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool,
          weights_float: bool, router_bias: torch.Tensor | None = None,
          topk_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, H], router_weight: [E, H], router_bias: [E] or None -> (routing weights [T, K], expert ids [T, K]
    int64), as transformers routes (topk_first: gpt-oss's top-k over the logits, then a softmax over the k)."""
    router_logits = F.linear(x, router_weight, router_bias)  # [T, E]
    if topk_first:
        top_logits, top_experts = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype), top_experts
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    top_weights, top_experts = torch.topk(probs, top_k, dim=-1)  # ties: topk's own order, as transformers
    if norm_topk_prob:
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    return (top_weights if weights_float else top_weights.to(router_logits.dtype)), top_experts


def _activation(gate: torch.Tensor, hidden_act: str) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") if hidden_act == "gelu_tanh" else F.silu(gate)


def _gated(gate_up: torch.Tensor, hidden_act: str, swiglu: tuple[float, float] | None) -> torch.Tensor:
    """gate_up: [n, 2I] (gate columns, then up) -> [n, I]. swiglu (limit, alpha): gpt-oss's clamped SwiGLU."""
    gate, up = gate_up.chunk(2, dim=-1)  # each [n, I]
    if swiglu is None:
        return _activation(gate, hidden_act) * up
    limit, alpha = swiglu
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def run_grouped(x: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor, num_experts: int,
                experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x: [T, H]; top_weights / top_experts: [T, K] -> [T, H]. experts(rows [T*K, H] sorted by expert, counts [E]
    int64) -> [T*K, H], each pair's expert output: the seam between the routing, here, and the experts' weights
    (StackedExperts' floats, worker.linears.ggml_experts' GGUF blocks). Experts with a routed(x, top_weights,
    top_experts) method do all of this themselves, to the same bits (GGMLBlocksExperts: one native call)."""
    routed = getattr(experts, "routed", None)
    if routed is not None:
        return routed(x, top_weights, top_experts)
    num_tokens, top_k = top_experts.shape
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat_experts = top_experts.reshape(-1)  # [T*K], pair p = token p // K, its (p % K)-th choice
    order = torch.argsort(flat_experts, stable=True)  # pairs grouped by expert, in token order within one
    pair_tokens = order // top_k  # [T*K]
    counts = torch.bincount(flat_experts, minlength=num_experts)  # [E]
    expert_out = experts(x.index_select(0, pair_tokens), counts)  # [T*K, H]
    weights = top_weights.reshape(-1).index_select(0, order)[:, None]  # [T*K, 1]
    out.index_add_(0, pair_tokens, (expert_out * weights).to(x.dtype))
    return out


def expert_matmuls(rows: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   hidden_act: str, gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                   swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """rows: [P, H] sorted by expert; counts: [E]; gate_up: [E, 2I, H]; down: [E, H, I]; the biases (gpt-oss)
    [E, 2I] and [E, H] or None -> [P, H]. Each expert that has rows runs gate/up and down once over all of them;
    one without costs nothing."""
    expert_out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        span = slice(start, start + count)
        gate_up_out = F.linear(rows[span], gate_up[expert], None if gate_up_bias is None else gate_up_bias[expert])
        expert_out[span] = F.linear(_gated(gate_up_out, hidden_act, swiglu), down[expert],
                                    None if down_bias is None else down_bias[expert])
        start += count
    return expert_out


def run_experts(x: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, hidden_act: str = "silu") -> torch.Tensor:
    """x: [T, H]; top_weights / top_experts: [T, K]; gate_up: [E, 2I, H]; down: [E, H, I] -> [T, H]."""
    return run_grouped(x, top_weights, top_experts, gate_up.shape[0],
                       lambda rows, counts: expert_matmuls(rows, counts, gate_up, down, hidden_act))


class StackedExperts(nn.Module):
    """Every expert's weights as stacked float parameters: (rows [P, H] sorted by expert, counts [E]) -> [P, H]."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.hidden_act = config.hidden_act
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * inter, hidden))  # [E, 2I, H]: gate rows, then up
        self.down = nn.Parameter(torch.empty(experts, hidden, inter))  # [E, H, I]
        # gpt-oss: biases on both matmuls, and its clamped SwiGLU (limit, alpha)
        self.gate_up_bias = nn.Parameter(torch.empty(experts, 2 * inter)) if config.expert_bias else None  # [E, 2I]
        self.down_bias = nn.Parameter(torch.empty(experts, hidden)) if config.expert_bias else None  # [E, H]
        self.swiglu = None if config.swiglu_limit is None else (config.swiglu_limit, config.swiglu_alpha)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return expert_matmuls(rows, counts, self.gate_up, self.down, self.hidden_act, self.gate_up_bias,
                              self.down_bias, self.swiglu)


class SparseMoE(nn.Module):
    """A decoder layer's feed-forward as top-k of config.num_experts SwiGLU experts. self.experts: StackedExperts,
    or (a GGUF file's experts under --cpu-block-kernels) worker.linears.ggml_experts.GGMLBlocksExperts, swapped in
    at load."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weights_float = config.router_weights_float
        self.router_weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))  # [E, H]
        self.router_bias = nn.Parameter(torch.empty(config.num_experts)) if config.router_bias else None  # [E]
        self.topk_first = config.router_topk_first
        self.experts = StackedExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, H] -> [T, H]
        top_weights, top_experts = route(x, self.router_weight, self.top_k, self.norm_topk_prob, self.weights_float,
                                         self.router_bias, self.topk_first)
        return run_grouped(x, top_weights, top_experts, self.num_experts, self.experts)
