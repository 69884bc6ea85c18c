"""Pipeline parallelism: a model split by layers over N ranks (stages), for nodes without a fast interconnect.

    rank 0:      embed, layers [0, L/N)          --send hidden [T, H]-->
    rank r:      layers [r L/N, (r+1) L/N)       --send hidden-->            (recv from r - 1)
    rank N - 1:  layers [.., L), norm, lm_head   --send logits [R, V] to rank 0 (it samples)

Every rank runs the same step (worker.parallel.step_mirror sends each batch to all), so each knows the step's
token count and logit rows without being told; a stage's KV cache holds its own layers of every page. One
step runs the stages one after the other (no micro-batches yet): the split buys memory, not speed.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from worker.model.llama import LlamaModel
from worker.parallel.group import TensorParallelGroup


def stage_layers(rank: int, num_stages: int, num_layers: int) -> range:
    """Rank's layers: contiguous, the first num_layers % num_stages stages one longer."""
    per_stage, extra = divmod(num_layers, num_stages)
    first = rank * per_stage + min(rank, extra)
    return range(first, first + per_stage + (rank < extra))


def check_stages(num_layers: int, num_stages: int) -> None:
    if num_stages > num_layers:
        raise ValueError(f"--pipeline-parallel-size {num_stages} is more stages than the model's {num_layers} layers")


class PipelineStage(nn.Module):
    """One rank's stage of a loaded model, with the forward and compute_logits the paths call on a model."""

    def __init__(self, model: LlamaModel, group: TensorParallelGroup) -> None:
        super().__init__()
        check_stages(model.config.num_layers, group.world_size)
        self.config = model.config
        self.group = group
        self.layer_range = stage_layers(group.rank, group.world_size, model.config.num_layers)
        self.first, self.last = group.rank == 0, group.rank == group.world_size - 1
        self.layers = nn.ModuleList(model.layers[index] for index in self.layer_range)
        self.dtype = next(self.layers.parameters()).dtype  # of the hidden states a stage receives
        # the whole model's other stages go with it; its embedding, norm and head only where they run
        model.layers = nn.ModuleList()
        if not self.last:
            model.norm = model.lm_head = None
        if not self.first and not (self.last and model.config.tie_word_embeddings):
            model.embed_tokens = None
        self.whole = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, attn_metadata) -> torch.Tensor:
        """[T] -> this stage's output [T, hidden] (the last stage's final-normed, like LlamaModel's)."""
        if self.first:
            h = self.whole.embed_input(input_ids)
        else:
            h = torch.empty(input_ids.shape[0], self.config.hidden_size, dtype=self.dtype, device=input_ids.device)
            dist.recv(h, src=self.group.rank - 1, group=self.group.process_group)
        tables = self.whole.rotary_tables(positions, h.dtype)[self.layer_range.start : self.layer_range.stop]
        for layer, key_cache, value_cache, kv_scales, (cos, sin) in zip(
                self.layers, kv_cache.key_caches, kv_cache.value_caches, kv_cache.layer_scales(), tables):
            h = layer(h, cos, sin, key_cache, value_cache, attn_metadata, kv_scales)  # kv_scales: quantized pages
        if not self.last:
            dist.send(h.contiguous(), dst=self.group.rank + 1, group=self.group.process_group)
            return h
        return self.whole.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, hidden] of the logit rows -> logits [R, vocab] float32 on rank 0 (from the last stage) and
        on the last stage; other stages get an empty tensor."""
        if self.last:
            logits = self.whole.compute_logits(hidden)
            if not self.first:
                dist.send(logits.contiguous(), dst=0, group=self.group.process_group)
            return logits
        if self.first:
            logits = torch.empty(hidden.shape[0], self.config.vocab_size, dtype=torch.float32, device=hidden.device)
            dist.recv(logits, src=self.group.world_size - 1, group=self.group.process_group)
            return logits
        return hidden.new_empty(0, self.config.vocab_size, dtype=torch.float32)
