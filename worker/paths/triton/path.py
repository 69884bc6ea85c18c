"""The Triton execution path: kernel forward, and on CUDA the staging, readback and decode graphs.

One step: host metadata (plain lists, prepare()) -> device tensors (through pinned staging on a copy
stream when stream overlap is on, started in prepare(); else plain torch.tensor copies in forward()) ->
a replayed decode graph when the step is decode-only and fits a bucket, else the eager kernel forward ->
logits of the rows that sample -> tokens. Batches without penalties or logprobs are sampled on the
device (argmax, or the sampling kernel for temperature / top-k / top-p / min-p) and the ids come back
in one copy (through the pinned readback on CUDA); batches with penalties or logprobs go through
worker.sampling.sampler.

Under async scheduling a staged step's placeholder rows (decode rows whose input the step before
samples) are written on the device from that step's sampled ids, which never leave it: forward()
index_copies them in on the compute stream, no host sync. When a placeholder reads another step's
token (or the last step sampled on the host), the host-filled ids go up instead.

--deterministic swaps in worker.paths.triton.batch_invariant's linears, attention metadata and kernels here, once.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Sequence

import torch

from core.step import TokenLogprobs
from worker.model.kv_cache import KVCache
from worker.model.llama import LlamaModel
from worker.paths.base import VARIABLE_EXPERT_ROWS, ResolvedExecution, moe_refusal
from worker.paths.triton.batch_invariant import batch_invariant_kernels, set_fixed_tile_linears, token_host_metadata
from worker.paths.triton.cuda_graphs import DecodeGraphs
from worker.paths.triton.forward import HostMetadata, host_metadata, load_kernels, to_device, triton_forward
from worker.paths.triton.staging import StagedStep, StepStager, TokenReadback
from worker.sampling.penalties import has_penalties
from worker.sampling.sampler import SamplingRow, draw_seed, sample
from worker.sampling.structured_output import TokenBitmask
from worker.step_batch import StepBatch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TritonInputs:
    host: HostMetadata
    staged: StagedStep | None = None  # already on its way up (CUDA, stream overlap)


class TritonPath:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, block_size: int, execution: ResolvedExecution,
                 device: torch.device) -> None:
        self.model, self.kv_cache, self.block_size, self.device = model, kv_cache, block_size, device
        if model.config.num_experts and execution.deterministic:  # resolve_execution refuses it first; by hand too
            raise ValueError(moe_refusal(model.config.architecture, "the Triton path under --deterministic",
                                         VARIABLE_EXPERT_ROWS))
        if model.config.num_experts:
            log.info("mixture of experts (%s): %d experts, top %d: routing in torch, stacked experts through the "
                     "fused-MoE kernel (worker.kernels.fused_moe)", model.config.architecture,
                     model.config.num_experts, model.config.num_experts_per_tok)
        # --deterministic (chosen here, once): fixed-tile linears, every query token a decode row in one split
        set_fixed_tile_linears(model, execution.deterministic)  # also undoes another runner's mode on this model
        self.kernels = batch_invariant_kernels(load_kernels()) if execution.deterministic else load_kernels()
        self.host_metadata = token_host_metadata if execution.deterministic else host_metadata
        self.stager = self.readback = self.graphs = None
        # (step id, its sampled ids [R] int64 on the device): what the next step's placeholder rows read
        self.last_device_tokens: tuple[int, torch.Tensor | None] = (-1, None)
        self.num_device_fills = 0  # staged steps whose placeholder rows were written from device tokens
        if execution.stream_overlap:  # resolve_execution() leaves these off unless the device is CUDA
            self.stager, self.readback = StepStager(device), TokenReadback(device)
        if execution.cuda_graphs:
            max_blocks = -(-model.config.max_position_embeddings // block_size)
            self.graphs = DecodeGraphs(model, kv_cache, self.kernels, execution.graph_batch_sizes,
                                       min(max_blocks, kv_cache.num_blocks), device)

    def prepare(self, batch: StepBatch) -> TritonInputs:
        host = self.host_metadata(batch.spans, self.block_size)
        if self.stager is None:
            return TritonInputs(host)
        # CUDA: the H2D copy starts now, while the step before runs
        staged = self.stager.stage(batch.input_ids, batch.positions, host, batch.placeholder_rows,
                                   [index for _, index in batch.placeholder_sources])
        return TritonInputs(host, staged)

    def forward(self, batch: StepBatch, inputs: TritonInputs) -> torch.Tensor:
        if inputs.staged is None:
            ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
            pos = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
            return self._logits(ids, pos, to_device(inputs.host, self.device), batch.logit_rows)
        ids, pos, metadata, rows, sources = self.stager.take(inputs.staged)
        if inputs.staged.num_placeholders:
            step_id, tokens = self.last_device_tokens
            if tokens is not None and all(source == step_id for source, _ in batch.placeholder_sources):
                values = tokens.index_select(0, sources)  # [P]
                self.num_device_fills += 1
            else:
                values = torch.tensor([batch.input_ids[row] for row in batch.placeholder_rows],
                                      dtype=torch.int64, device=self.device)
            ids.index_copy_(0, rows, values)
        logits = self._logits(ids, pos, metadata, batch.logit_rows)
        self.stager.mark_consumed(inputs.staged)
        return logits

    def _logits(self, ids: torch.Tensor, pos: torch.Tensor, metadata, sample_rows: Sequence[int]) -> torch.Tensor:
        """[len(sample_rows), vocab] float32 (sample_rows: the batch's logit_rows): a replayed decode graph
        when one fits, else the eager kernel forward."""
        bucket = None
        if self.graphs is not None and metadata.decode_only:
            bucket = self.graphs.bucket_for(metadata.context_lens.shape[0], metadata.block_tables.shape[1])
        if bucket is not None:
            all_logits = self.graphs.replay(ids, pos, metadata)  # [B, vocab]: decode rows, one per request
            # sample rows come before prompt-logprob rows, so "all rows" must also mean "in batch order"
            in_order = len(sample_rows) == ids.shape[0] and list(sample_rows) == list(range(ids.shape[0]))
            return all_logits if in_order else all_logits[list(sample_rows)]
        hidden = triton_forward(self.model, ids, pos, self.kv_cache, metadata, self.kernels)
        return self.model.compute_logits(hidden[list(sample_rows)])

    def sample(self, batch: StepBatch, logits: torch.Tensor, rows: Sequence[SamplingRow],
               token_bitmask: TokenBitmask | None = None) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Batches without penalties, logprobs or logit_bias are sampled on the device (sample_tokens, which applies
        the constrained rows' token bitmask in its pass) and read back once; the others go through
        worker.sampling.sampler."""
        self.last_device_tokens = (batch.step_id, None)
        if not rows:
            return [], []
        if any(has_penalties(row.params) or row.params.logprobs is not None or row.params.logit_bias for row in rows):
            return sample(logits, rows, token_bitmask)
        if token_bitmask is None and all(row.params.greedy for row in rows):
            token_ids = logits.argmax(dim=-1)  # [R]
        else:
            bitmask = None if token_bitmask is None else token_bitmask.full(len(rows)).to(logits.device).contiguous()
            token_ids = self.kernels.sample_tokens(logits, **self._row_params(rows),
                                                   token_bitmask=bitmask)  # [R] int64, no host sync
        self.last_device_tokens = (batch.step_id, token_ids)
        if self.readback is not None:
            self.readback.start(token_ids)
            return self.readback.finish(), [None] * len(rows)
        return token_ids.tolist(), [None] * len(rows)

    def _row_params(self, rows: Sequence[SamplingRow]) -> dict[str, torch.Tensor | None]:
        """Per-row sampling parameters as device tensors; None for a filter no row uses (skips the sort).

        Seeds: a seeded request's draw_seed(seed, outputs so far), as worker.sampling.sampler, so its tokens do
        not depend on the batch; the others a fresh random int64.
        """
        params = [row.params for row in rows]
        seeds = [draw_seed(p.seed, row.num_output_tokens) if p.seed is not None else random.getrandbits(63)
                 for p, row in zip(params, rows)]

        def column(values, dtype, unused) -> torch.Tensor | None:
            if unused is not None and all(value == unused for value in values):
                return None
            return torch.tensor(values, dtype=dtype, device=self.device)

        return {
            "temperature": column([p.temperature for p in params], torch.float32, None),
            "top_k": column([p.top_k if p.top_k > 0 else 0 for p in params], torch.int64, 0),
            "top_p": column([p.top_p for p in params], torch.float32, 1.0),
            "min_p": column([p.min_p for p in params], torch.float32, 0.0),
            "seeds": column(seeds, torch.int64, None),
        }

    def warm_up(self) -> None:
        if self.graphs is not None:
            self.graphs.capture()
