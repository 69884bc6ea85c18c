"""The ModelRunner's Triton backend: kernel forward, and on CUDA the staging, readback and decode graphs.

One step: host metadata (plain lists) -> device tensors (through pinned staging on a copy stream when
stream overlap is on, else plain torch.tensor copies) -> a replayed decode graph when the step is
decode-only and fits a bucket, else the eager kernel forward -> logits of the rows that sample ->
tokens. All-plain-greedy batches take the argmax on the device and bring the ids back through the
pinned readback; anything else (temperature, penalties, logprobs) goes through worker.sampler, which
already runs on the logits' device.
"""
from __future__ import annotations

from typing import Sequence

import torch

from scheduler.plan import TokenLogprobs
from worker.attention import RequestSpan
from worker.backends import ResolvedExecution
from worker.kv_cache import KVCache
from worker.model import LlamaModel
from worker.sampler import SamplingRow, _is_plain_greedy, sample
from worker.triton_forward import HostMetadata, host_metadata, load_kernels, to_device, triton_forward


class KernelPath:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, block_size: int, execution: ResolvedExecution,
                 device: torch.device) -> None:
        self.model, self.kv_cache, self.block_size, self.device = model, kv_cache, block_size, device
        self.execution = execution
        self.kernels = load_kernels()
        self.stager = self.readback = self.graphs = None
        if execution.stream_overlap:  # resolve_execution() leaves these off unless the device is CUDA
            from worker.step_staging import StepStager, TokenReadback

            self.stager, self.readback = StepStager(device), TokenReadback(device)
        if execution.cuda_graphs:
            from worker.cuda_graphs import DecodeGraphs

            max_blocks = -(-model.config.max_position_embeddings // block_size)
            self.graphs = DecodeGraphs(model, kv_cache, self.kernels, execution.graph_batch_sizes,
                                       min(max_blocks, kv_cache.num_blocks), device)

    def warm_up(self) -> None:
        if self.graphs is not None:
            self.graphs.capture()

    def host_metadata(self, spans: Sequence[RequestSpan]) -> HostMetadata:
        return host_metadata(spans, self.block_size)

    def logits(self, input_ids: Sequence[int], positions: Sequence[int], host: HostMetadata,
               sample_rows: Sequence[int]) -> torch.Tensor:
        """[R, vocab] float32 for the rows in sample_rows."""
        if self.stager is not None:
            ids, pos, metadata = self.stager.stage(input_ids, positions, host)
        else:
            ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)
            metadata = to_device(host, self.device)
        bucket = None
        if self.graphs is not None and metadata.decode_only:
            bucket = self.graphs.bucket_for(len(host.context_lens), metadata.block_tables.shape[1])
        if bucket is not None:
            all_logits = self.graphs.replay(ids, pos, metadata)  # [B, vocab]: decode rows, one per request
            logits = all_logits[list(sample_rows)] if len(sample_rows) != ids.shape[0] else all_logits
        else:
            hidden = triton_forward(self.model, ids, pos, self.kv_cache, metadata, self.kernels)
            logits = self.model.compute_logits(hidden[list(sample_rows)])
        if self.stager is not None:
            self.stager.mark_consumed()
        return logits

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
        if not rows:
            return [], []
        if self.readback is not None and all(_is_plain_greedy(row.params) for row in rows):
            self.readback.start(logits.argmax(dim=-1))
            return self.readback.finish(), [None] * len(rows)
        return sample(logits, rows)
