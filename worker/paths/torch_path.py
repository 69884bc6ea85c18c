"""The torch execution path: worker.model.llama.LlamaModel in plain torch, the reference every faster path matches.

It runs on any device, and is the CPU path: float32 linears on weights reordered once for oneDNN
(worker.linears.packed, when the resolved options say so), the decoder's small ops and decode attention on
the pages in place as compiled ops (worker.paths.fused_ops' forward, chosen here once; without them, decode attention batched through
one reused gather workspace, worker.model.attention). Sampling is worker.sampling.sampler on the logits' device.
--deterministic swaps in worker.paths.batch_invariant's linears and attention plan here, once.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from core.step import TokenLogprobs
from worker.linears.dense_weights import keep_dense_weights
from worker.linears.ggml_blocks import describe_block_kernels
from worker.linears.ggml_experts import describe_experts
from worker.linears.group_quant import use_int8_activations
from worker.linears.packed import pack_linears
from worker.model.attention import GatherWorkspace, HostAttentionPlan, attention_metadata, plan_attention
from worker.model.kv_cache import KVCache
from worker.model.llama import LlamaModel
from worker.paths.base import ResolvedExecution
from worker.paths.batch_invariant import plan_batch_invariant_attention, set_batch_invariant
from worker.paths.fused_ops import FusedDecoder, fused_ops_usable
from worker.paths.thread_governor import ThreadGovernor
from worker.sampling.sampler import SamplingRow, sample
from worker.sampling.structured_output import TokenBitmask
from worker.step_batch import StepBatch

log = logging.getLogger(__name__)


class TorchPath:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, block_size: int, execution: ResolvedExecution,
                 device: torch.device, decode_group_bytes: int) -> None:
        self.model, self.kv_cache, self.block_size, self.device = model, kv_cache, block_size, device
        block_numel = kv_cache.storage[0, 0, 0].numel()  # one page of one layer: this rank's KV heads only
        # the activations' dtype: the pages' own, or what quantized pages dequantize to (a pipeline stage has no
        # final norm, so the first layer's parameters say it)
        model_dtype = kv_cache.storage.dtype if kv_cache.scales is None else next(model.layers.parameters()).dtype
        self.gather_workspace = GatherWorkspace(block_numel, model_dtype, device, decode_group_bytes)
        if execution.packed_linears:
            pack_linears(model)  # in place: the model's linears now read oneDNN-reordered weights
        if execution.cpu_int8_activations:
            use_int8_activations(model)
        log.info("dense weights for many-row steps: %s",
                 keep_dense_weights(model, execution.cpu_dense_weights, model_dtype))
        if model.config.num_experts:  # a GGUF file's experts on its blocks (--cpu-block-kernels), else floats
            log.info("mixture of experts (%s): %d experts, top %d: %s", model.config.architecture,
                     model.config.num_experts, model.config.num_experts_per_tok, describe_experts(model))
        blocks = describe_block_kernels(model)
        if blocks:
            log.info("GGML block kernels: %s", blocks)
        # decode attention then reads the pages in place: the plan skips the gather groups
        self.fused_ops = execution.cpu_fused_ops and torch.device(device).type == "cpu" and fused_ops_usable(model)
        # the forward, chosen once: the compiled ops over the model's weights, or the model itself (the reference)
        self.decoder = FusedDecoder(model) if self.fused_ops else model
        log.info("decoder ops: %s", "compiled, decode attention on the KV pages in place" if self.fused_ops
                 else "plain torch (the reference)")
        # --deterministic: each token's sums in an order its step's other rows do not change (chosen here, once)
        set_batch_invariant(model, execution.deterministic)
        self.plan_attention = plan_batch_invariant_attention if execution.deterministic else plan_attention
        if execution.deterministic:
            log.info("deterministic: linears in fixed 16-row tiles or on the row kernel, every query token through "
                     "the decode attention (worker.paths.batch_invariant)")
        # spinning OpenMP threads beside another busy process: one thread until the cores are free again
        self.thread_governor = (ThreadGovernor(torch.get_num_threads()) if torch.device(device).type == "cpu"
                                else None)

    def prepare(self, batch: StepBatch) -> HostAttentionPlan:
        # the tensors are made in forward(), on the compute thread
        return self.plan_attention(batch.spans, self.block_size, self.gather_workspace, in_place=self.fused_ops)

    def forward(self, batch: StepBatch, inputs: HostAttentionPlan) -> torch.Tensor:
        started = time.perf_counter_ns()
        metadata = attention_metadata(inputs, self.block_size, self.device, self.gather_workspace)
        hidden = self.decoder(
            torch.tensor(batch.input_ids, dtype=torch.long, device=self.device),
            torch.tensor(batch.positions, dtype=torch.long, device=self.device),
            self.kv_cache,
            metadata,
        )  # [T, hidden]
        logits = self.model.compute_logits(hidden[batch.logit_rows])  # [R + Q, vocab] float32
        if self.thread_governor is not None:  # on the compute thread, whose OpenMP team it sizes
            self.thread_governor.after_step(time.perf_counter_ns() - started)
        return logits

    def sample(self, batch: StepBatch, logits: torch.Tensor, rows: Sequence[SamplingRow],
               token_bitmask: TokenBitmask | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
        return sample(logits, rows, token_bitmask) if rows else ([], [])

    def warm_up(self) -> None:
        pass  # nothing to capture: the first forward pass was all the warming this path needs
