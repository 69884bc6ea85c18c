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

from worker.loader.share import cut
from worker.model.config import ModelConfig
from worker.model.llama import LlamaModel
from worker.model.moe import StackedExperts
from worker.parallel.group import TensorParallelGroup
from worker.parallel.layers import GatheredLMHead, SumOverRanks, VocabParallelEmbedding
from worker.parallel.shard_weights import QUANTIZED, embedding_on, keep_columns, keep_rows, linear_on, weight_of


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
    if config.attention_sinks and world_size > 1:  # gpt-oss
        raise ValueError(f"{flag}: {config.architecture}'s attention sinks (one per query head), attention output bias "
                         f"and expert biases have no split yet: the row-parallel o_proj's and experts' down biases "
                         f"would be added once per rank before the all-reduce")
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

    @property
    def vocab_range(self) -> range:  # this rank's rows of the vocabulary (the last rank's may be fewer than V')
        return range(min(self.rank * self.vocab_rows, self.config.vocab_size),
                     min((self.rank + 1) * self.vocab_rows, self.config.vocab_size))

    def qkv_rows(self) -> list[range]:
        """This rank's rows of the fused [q | k | v] projection: its q heads, then its KV heads of k and of v."""
        config, head_dim = self.config, self.config.head_dim
        q, kv = self.q_heads, self.kv_heads
        return [range(q.start * head_dim, q.stop * head_dim)] + [
            range(offset + kv.start * head_dim, offset + kv.stop * head_dim)
            for offset in (config.q_size, config.q_size + config.kv_size)]

    def halves_rows(self, width: int) -> list[range]:
        """This rank's rows of a fused [gate | up] projection whose halves are `width` rows each."""
        columns = self.columns(width)
        return [range(columns.start, columns.stop), range(width + columns.start, width + columns.stop)]

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


@dataclass(frozen=True, slots=True)
class HfShare:
    """A rank's share as the loader reads it from a Hugging Face folder (worker.loader.share.TensorShare): the
    same rows and columns split_tensor keeps of the fused model, named by the file's tensors."""

    split: RankSplit

    def part(self, name: str) -> tuple[int, list[range]] | None:
        split, config = self.split, self.split.config
        head_dim = config.head_dim
        q, kv = split.q_heads, split.kv_heads
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return 0, [range(q.start * head_dim, q.stop * head_dim)]
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                          "self_attn.v_proj.bias")):
            return 0, [range(kv.start * head_dim, kv.stop * head_dim)]
        if name.endswith("self_attn.qkv_proj.weight"):
            return 0, split.qkv_rows()
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            return 1, [_range(split.columns(config.q_size if "o_proj" in name else config.intermediate_size))]
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return 0, [_range(split.columns(config.intermediate_size))]
        if name.endswith("mlp.gate_up_proj.weight"):
            return 0, split.halves_rows(config.intermediate_size)
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]
            return 1, split.halves_rows(config.moe_intermediate_size)
        if name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            return 2, [_range(split.columns(config.moe_intermediate_size))]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, [split.vocab_range]
        return None  # norms, the router: every rank holds them whole

    def pad(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return _padded_vocab(tensor, self.split) if name in ("model.embed_tokens.weight", "lm_head.weight") else tensor

    def rank_config(self) -> ModelConfig:
        return self.split.rank_config()


def _range(columns: slice) -> range:
    return range(columns.start, columns.stop)


def _padded_vocab(local: torch.Tensor, split: RankSplit) -> torch.Tensor:
    """The rank's vocabulary rows with zero rows after them up to V', as many on every rank."""
    return torch.cat((local, local.new_zeros(split.vocab_rows - local.shape[0], *local.shape[1:])))


def split_tensor(name: str, tensor: torch.Tensor, split: RankSplit) -> torch.Tensor:
    """This rank's part of the full model's state-dict entry `name` (replicated where the table says so)."""
    if name.endswith(("attn.wqkv.weight", "attn.wqkv.bias")):
        return cut(tensor, 0, split.qkv_rows())
    if name.endswith("attn.wo.weight"):
        return tensor[:, split.columns(tensor.shape[1])]
    if name.endswith("mlp.w_gate_up.weight"):
        return cut(tensor, 0, split.halves_rows(tensor.shape[0] // 2))
    if name.endswith("mlp.w_down.weight"):
        return tensor[:, split.columns(tensor.shape[1])]
    if name.endswith("mlp.experts.gate_up"):  # [E, 2I, H]
        return cut(tensor, 1, split.halves_rows(tensor.shape[1] // 2))
    if name.endswith("mlp.experts.down"):  # [E, H, I]
        return tensor[:, :, split.columns(tensor.shape[2])]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return _padded_vocab(tensor[split.vocab_range.start : split.vocab_range.stop], split)
    return tensor


def _split_quantized(name: str, module: nn.Module, split: RankSplit) -> nn.Module:
    """A quantized q/k/v, o, gate/up or down linear's share: rows for the column-parallel ones, input columns
    (on quant-group boundaries) for the row-parallel ones (worker.parallel.shard_weights)."""
    weight, bias = weight_of(module), module.bias
    if name.endswith("attn.wqkv"):
        ranges = split.qkv_rows()
    elif name.endswith("mlp.w_gate_up"):
        ranges = split.halves_rows(weight.out_features // 2)
    else:  # o and down: a partial sum on every rank, which SumOverRanks adds up; neither has a bias
        return linear_on(keep_columns(weight, split.columns(weight.in_features), name), None)
    return linear_on(keep_rows(weight, ranges), None if bias is None else cut(bias, 0, ranges))


def _vocabulary(whole: LlamaModel, local: LlamaModel, split: RankSplit) -> tuple[nn.Module, nn.Module]:
    """The rank's vocabulary rows of the embedding and lm_head: float ones from the split state dict (padded),
    quantized ones cut from the file's weight (the embedding's rows unpadded: a view of the file's pages; the
    head padded with zero rows, so every rank gathers as many logits)."""
    embed, head, rows = whole.embed_tokens, whole.lm_head, split.vocab_range
    if isinstance(embed, QUANTIZED):
        local_embed = embedding_on(keep_rows(weight_of(embed), [rows]), embed.dtype)
    else:
        local_embed = local.embed_tokens
    if isinstance(head, QUANTIZED):
        local_head = linear_on(keep_rows(weight_of(head), [rows], split.vocab_rows), None)
    elif whole.config.tie_word_embeddings:  # the float tie kept: the head runs on the embedding's split rows
        local_head = nn.Linear(whole.config.hidden_size, split.vocab_rows, bias=False, device="meta")
        local_head.weight = local.embed_tokens.weight
    else:
        local_head = local.lm_head
    return local_embed, local_head


def _check_experts(model: LlamaModel) -> None:
    for name, module in model.named_modules():
        if name.endswith("mlp.experts") and type(module) is not StackedExperts:
            raise ValueError(f"tensor parallelism splits float experts; {name} is a {type(module).__name__} "
                             f"(a GGUF file's expert blocks are not split yet: use --quantization none)")


def shard_model(model: LlamaModel, group: TensorParallelGroup) -> LlamaModel:
    """This rank's share of `model` (the whole model, loaded the same on every rank), as a LlamaModel of the
    rank's config with the parallel modules swapped in; `model` is left as it was. One rank: `model` itself."""
    config = model.config
    if group.world_size == 1:
        return model
    check_split(config, group.world_size)
    _check_experts(model)
    split = RankSplit(group.rank, group.world_size, config)
    quantized = {name: module for name, module in model.named_modules() if isinstance(module, QUANTIZED)}
    inside_quantized = tuple(f"{name}." for name in quantized)
    with torch.device("meta"):
        local = LlamaModel(split.rank_config())
    state = {name: split_tensor(name, tensor, split).clone() for name, tensor in model.state_dict().items()
             if not name.startswith(inside_quantized)}
    local.load_state_dict(state, assign=True, strict=False)  # the quantized modules' places are filled below
    for name, module in quantized.items():
        if name not in ("embed_tokens", "lm_head"):
            parent, _, child = name.rpartition(".")
            setattr(local.get_submodule(parent), child, _split_quantized(name, module, split))
    local.embed_tokens, local.lm_head = _vocabulary(model, local, split)
    left = [name for name, tensor in [*local.named_parameters(), *local.named_buffers()] if tensor.is_meta]
    if left:
        raise ValueError(f"tensor parallelism has no split for {left[:4]} (a {config.architecture} model)")
    return _wrap(local, split, group)


def wrap_share(local: LlamaModel, config: ModelConfig, group: TensorParallelGroup) -> LlamaModel:
    """A share the loader read as such (load_model with HfShare: the rank's rows and columns of a Hugging Face
    folder, vocabulary rows padded), with the collectives swapped in: what shard_model makes of the whole model."""
    if group.world_size == 1:
        return local
    return _wrap(local, RankSplit(group.rank, group.world_size, config), group)


def _wrap(local: LlamaModel, split: RankSplit, group: TensorParallelGroup) -> LlamaModel:
    """The collectives around a share whose embed_tokens / lm_head hold the rank's vocabulary rows."""
    local.config = split.config  # the forward reads the whole model's sizes (hidden, vocab) from it
    rows = split.vocab_range
    local.embed_tokens = VocabParallelEmbedding(local.embed_tokens, rows.start, len(rows), group)
    local.lm_head = GatheredLMHead(local.lm_head, split.config.vocab_size, group)
    for layer in local.layers:
        layer.attn = SumOverRanks(layer.attn, group)
        layer.mlp = SumOverRanks(layer.mlp, group)
    return local.eval()
