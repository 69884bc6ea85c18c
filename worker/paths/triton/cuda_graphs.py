"""CUDA only: decode-only steps replay a CUDA graph captured per batch-size bucket.

A decode step of B rows (one query token each) runs the graph of the smallest bucket >= B. Every
graph reads the same static buffers, sized for the largest bucket: token ids, positions, slot
mapping, block tables [max_bucket, max_blocks], context lengths. A step copies its own values into
the first B rows in place (device-to-device, on the stream the graph replays on) and pads the rest
with rows that write nothing (slot -1) and attend to one slot of block 0, so a padded row costs a
little compute and never touches a live page. Logits come out of the graph for every bucket row;
the caller keeps the rows that sample.

Graphs are captured largest bucket first so that the smaller ones share its memory pool.
"""
from __future__ import annotations

import torch

from worker.model.kv_cache import KVCache
from worker.model.llama import LlamaModel
from worker.paths.triton.forward import KernelMetadata, TritonKernels, triton_forward


def graph_bucket(batch_size: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest captured batch size that holds batch_size rows; None: too big, run eagerly."""
    for bucket in buckets:
        if bucket >= batch_size:
            return bucket
    return None


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, kernels: TritonKernels,
                 batch_sizes: tuple[int, ...], max_blocks_per_seq: int, device: torch.device) -> None:
        self.model, self.kv_cache, self.kernels = model, kv_cache, kernels
        self.batch_sizes = batch_sizes
        self.max_blocks_per_seq = max_blocks_per_seq
        max_rows = batch_sizes[-1]
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)  # [Bmax]
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)  # [Bmax]
        self.slot_mapping = torch.full((max_rows,), -1, dtype=torch.int64, device=device)  # [Bmax]
        self.block_tables = torch.zeros(max_rows, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(max_rows, dtype=torch.int32, device=device)  # [Bmax]
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # one token a row
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # bucket -> [bucket, vocab] float32, written by replay

    def _forward(self, rows: int) -> torch.Tensor:
        metadata = KernelMetadata(self.slot_mapping[:rows], self.block_tables[:rows], self.query_start_loc[: rows + 1],
                                  self.context_lens[:rows], decode_only=True)
        hidden = triton_forward(self.model, self.input_ids[:rows], self.positions[:rows], self.kv_cache, metadata, self.kernels)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for rows in reversed(self.batch_sizes):
            # warm-up outside the graph on a side stream: compiles the kernels and settles the allocator
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._forward(rows)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[rows] = self._forward(rows)
            pool = graph.pool()
            self.graphs[rows] = graph
        torch.cuda.synchronize()

    def bucket_for(self, num_rows: int, max_blocks: int) -> int | None:
        """The bucket a decode step of num_rows rows replays, or None (run it eagerly; also before capture())."""
        bucket = graph_bucket(num_rows, self.batch_sizes)
        return bucket if max_blocks <= self.max_blocks_per_seq and bucket in self.graphs else None

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: KernelMetadata) -> int:
        """Copies a decode step into the static buffers in place and pads it to its bucket; returns the bucket.

        Separate from replay() so that what a graph reads can be checked without CUDA (run _forward(bucket)).
        """
        rows = input_ids.shape[0]
        bucket = graph_bucket(rows, self.batch_sizes)
        max_blocks = metadata.block_tables.shape[1]
        self.input_ids[:rows].copy_(input_ids, non_blocking=True)
        self.positions[:rows].copy_(positions, non_blocking=True)
        self.slot_mapping[:rows].copy_(metadata.slot_mapping, non_blocking=True)
        self.block_tables[:rows, :max_blocks].copy_(metadata.block_tables, non_blocking=True)
        self.context_lens[:rows].copy_(metadata.context_lens, non_blocking=True)
        if bucket > rows:  # padding rows: write nothing, read one slot of block 0
            self.input_ids[rows:bucket].fill_(0)
            self.slot_mapping[rows:bucket].fill_(-1)
            self.context_lens[rows:bucket].fill_(1)
            self.block_tables[rows:bucket, 0].fill_(0)
        return bucket

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: KernelMetadata) -> torch.Tensor:
        """A decode-only step that bucket_for() accepted -> logits [B, vocab] float32 (a view; valid until the next replay)."""
        bucket = self.load(input_ids, positions, metadata)
        self.graphs[bucket].replay()
        return self.logits[bucket][: input_ids.shape[0]]
