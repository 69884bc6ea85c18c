"""One rank's share of a loaded model (tensor parallelism, Megatron's split; vLLM's and SGLang's layout).

Per decoder layer, with H query heads, KVH K/V heads, N ranks, rank r:

    wqkv  [q | k | v] rows   -> rank r's q heads  [r*H/N, (r+1)*H/N)          column-parallel: no
                                 and its KV heads [r*KVH/N, (r+1)*KVH/N)       communication
                                 (N > KVH: the one head r*KVH//N, shared by N/KVH ranks, GQA replicated)
    wo    columns of its q heads                                               row-parallel: all-reduce
    gate/up rows [r*I/N, (r+1)*I/N) of each half; down those columns           row-parallel: all-reduce
    MoE   every expert's gate/up/down the same way over moe_intermediate_size;
          the router replicated (every rank routes every token alike)
    embed / lm_head  vocabulary rows [r*V', (r+1)*V'), V' = ceil(V/N), the last rank's padded with zeros;
          lm_head's logits gathered for sampling
    norms replicated

Each rank's KV cache then holds its own KV heads of every page: the scheduler's page ids and block tables
are the same on every rank, so its page accounting does not change.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from worker.model.config import ModelConfig
from worker.model.llama import LlamaModel
from worker.model.moe import StackedExperts
from worker.parallel.group import TensorParallelGroup
from worker.parallel.layers import GatheredLMHead, SumOverRanks, VocabParallelEmbedding


def check_split(config: ModelConfig, world_size: int) -> None:
    """Raises ValueError naming the flag, the size and the model's count it does not fit."""
    flag = f"--tensor-parallel-size {world_size}"
    if world_size < 1:
        raise ValueError(f"{flag}: the size must be at least 1")
    if world_size > config.num_heads:
        raise ValueError(f"{flag} is larger than the model's {config.num_heads} query heads allow")
    if config.num_heads % world_size:
        raise ValueError(f"{flag} does not divide the model's {config.num_heads} query heads")
    kv_heads = config.num_kv_heads
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"{flag} must divide the model's {kv_heads} KV heads or be a multiple of them "
                         f"(then each KV head is kept by several ranks)")
    has_dense = config.num_experts == 0 or bool(config.dense_mlp_layers)
    if has_dense and config.intermediate_size % world_size:
        raise ValueError(f"{flag} does not divide the model's intermediate_size {config.intermediate_size}")
    if config.num_experts and config.moe_intermediate_size % world_size:
        raise ValueError(f"{flag} does not divide the experts' moe_intermediate_size {config.moe_intermediate_size}")
    if config.qk_norm_whole and world_size > 1:  # olmoe
        raise ValueError(f"{flag}: {config.architecture}'s q/k norms span the whole projection, every rank's "
                         f"heads at once; splitting them needs an all-reduce inside the norm, not built")


@dataclass(frozen=True, slots=True)
class RankSplit:
    """Which rows of each split weight rank `rank` of `world_size` holds (the table in the docstring)."""

    rank: int
    world_size: int
    config: ModelConfig  # the whole model's

    @property
    def q_heads(self) -> range:
        per_rank = self.config.num_heads // self.world_size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)

    @property
    def kv_heads(self) -> range:
        kv_heads, world = self.config.num_kv_heads, self.world_size
        if kv_heads >= world:
            per_rank = kv_heads // world
            return range(self.rank * per_rank, (self.rank + 1) * per_rank)
        first = self.rank * kv_heads // world
        return range(first, first + 1)

    @property
    def vocab_rows(self) -> int:  # V' on every rank, the last one's padded
        return -(-self.config.vocab_size // self.world_size)

    def columns(self, width: int) -> slice:
        per_rank = width // self.world_size
        return slice(self.rank * per_rank, (self.rank + 1) * per_rank)

    def rank_config(self) -> ModelConfig:
        """The config of this rank's modules: its heads, its columns, its vocabulary rows."""
        config, world = self.config, self.world_size
        return replace(config, num_heads=len(self.q_heads), num_kv_heads=len(self.kv_heads),
                       intermediate_size=config.intermediate_size // world,
                       moe_intermediate_size=config.moe_intermediate_size // world, vocab_size=self.vocab_rows,
                       tie_word_embeddings=False)  # the tie is kept by GatheredLMHead sharing the weight


def _heads(weight: torch.Tensor, heads: range, head_dim: int, offset: int = 0) -> torch.Tensor:
    return weight[offset + heads.start * head_dim : offset + heads.stop * head_dim]


def _split_qkv(weight: torch.Tensor, split: RankSplit) -> torch.Tensor:
    """[q | k | v] rows (weight [(H + 2 KVH) D, hidden] or its bias) -> this rank's heads of each."""
    config, head_dim = split.config, split.config.head_dim
    q = _heads(weight, split.q_heads, head_dim)
    k = _heads(weight, split.kv_heads, head_dim, config.q_size)
    v = _heads(weight, split.kv_heads, head_dim, config.q_size + config.kv_size)
    return torch.cat((q, k, v))


def _split_halves(weight: torch.Tensor, split: RankSplit, dim: int) -> torch.Tensor:
    """[gate | up] along dim -> this rank's columns of each half."""
    gate, up = weight.chunk(2, dim=dim)
    columns = split.columns(gate.shape[dim])
    index = (slice(None),) * dim + (columns,)
    return torch.cat((gate[index], up[index]), dim=dim)


def _split_vocab(weight: torch.Tensor, split: RankSplit) -> torch.Tensor:
    rows = split.vocab_rows
    local = weight[split.rank * rows : (split.rank + 1) * rows]
    return torch.cat((local, local.new_zeros(rows - local.shape[0], *local.shape[1:])))


def split_tensor(name: str, tensor: torch.Tensor, split: RankSplit) -> torch.Tensor:
    """This rank's part of the full model's state-dict entry `name` (replicated where the table says so)."""
    if name.endswith(("attn.wqkv.weight", "attn.wqkv.bias")):
        return _split_qkv(tensor, split)
    if name.endswith("attn.wo.weight"):
        return _heads(tensor.t(), split.q_heads, split.config.head_dim).t()
    if name.endswith("mlp.w_gate_up.weight"):
        return _split_halves(tensor, split, dim=0)
    if name.endswith("mlp.w_down.weight"):
        return tensor[:, split.columns(tensor.shape[1])]
    if name.endswith("mlp.experts.gate_up"):  # [E, 2I, H]
        return _split_halves(tensor, split, dim=1)
    if name.endswith("mlp.experts.down"):  # [E, H, I]
        return tensor[:, :, split.columns(tensor.shape[2])]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return _split_vocab(tensor, split)
    return tensor


def _check_float_weights(model: LlamaModel) -> None:
    for name, module in model.named_modules():
        if name.endswith(("attn.wqkv", "attn.wo", "mlp.w_gate_up", "mlp.w_down")) and type(module) is not nn.Linear:
            raise ValueError(f"tensor parallelism splits float weights; {name} is a {type(module).__name__} "
                             f"(quantized or block weights are not split yet: use --quantization none)")
        if name.endswith("mlp.experts") and type(module) is not StackedExperts:
            raise ValueError(f"tensor parallelism splits float experts; {name} is a {type(module).__name__}")


def shard_model(model: LlamaModel, group: TensorParallelGroup) -> LlamaModel:
    """This rank's share of `model` (the whole model, loaded the same on every rank), as a LlamaModel of the
    rank's config with the parallel modules swapped in; `model` is left as it was. One rank: `model` itself."""
    config = model.config
    if group.world_size == 1:
        return model
    check_split(config, group.world_size)
    _check_float_weights(model)
    split = RankSplit(group.rank, group.world_size, config)
    with torch.device("meta"):
        local = LlamaModel(split.rank_config())
    state = {name: split_tensor(name, tensor, split).clone() for name, tensor in model.state_dict().items()}
    local.load_state_dict(state, assign=True)
    local.config = config  # the forward reads the whole model's sizes (hidden, vocab) from it
    embed = local.embed_tokens.weight
    local.embed_tokens = VocabParallelEmbedding(embed, split.rank * split.vocab_rows, group)
    head_weight = embed if config.tie_word_embeddings else local.lm_head.weight
    local.lm_head = GatheredLMHead(head_weight, config.vocab_size, group)
    for layer in local.layers:
        layer.attn = SumOverRanks(layer.attn, group)
        layer.mlp = SumOverRanks(layer.mlp, group)
    return local.eval()
