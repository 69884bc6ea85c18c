"""What a captured decode graph computes, checked without CUDA: DecodeGraphs.load() puts a step into the
static buffers and pads it to its bucket, and the forward over those buffers (the code a graph captures)
gives the eager step's logits and writes exactly the eager step's K/V (padding rows write nothing)."""
from __future__ import annotations

import torch

from tests.gpu.random_model import random_llama, tiny_config
from worker.model.kv_cache import allocate_kv_cache
from worker.paths.triton.cuda_graphs import DecodeGraphs
from worker.paths.triton.forward import build_kernel_metadata, load_kernels, triton_forward
from worker.step_batch import RequestSpan

BLOCK_SIZE = 4


def test_static_buffers_pad_to_the_bucket_and_match_the_eager_step():
    config = tiny_config(num_layers=1)
    model = random_llama(config, torch.float32, "cpu", seed=7, std=0.2)
    kernels = load_kernels()
    eager_cache = allocate_kv_cache(config, 12, BLOCK_SIZE, torch.float32)
    eager_cache.storage.normal_(generator=torch.Generator().manual_seed(0))  # a "previous" context in every page
    graph_cache = allocate_kv_cache(config, 12, BLOCK_SIZE, torch.float32)
    graph_cache.storage.copy_(eager_cache.storage)
    graphs = DecodeGraphs(model, graph_cache, kernels, (1, 2, 4), max_blocks_per_seq=4, device=torch.device("cpu"))

    # a wider step first leaves stale entries in the static block tables, then a narrower 3-row step
    for spans in ([RequestSpan(0, 1, 13, [4, 5, 6, 7]), RequestSpan(1, 1, 2, [8])],
                  [RequestSpan(0, 1, 6, [3, 5]), RequestSpan(1, 1, 3, [7]), RequestSpan(2, 1, 8, [9, 10])]):
        metadata = build_kernel_metadata(spans, BLOCK_SIZE, "cpu")
        rows = len(spans)
        ids = torch.tensor([5, 9, 200][:rows])
        positions = torch.tensor([span.context_len - 1 for span in spans])
        bucket = graphs.load(ids, positions, metadata)
        assert bucket == {2: 2, 3: 4}[rows]
        with torch.inference_mode():
            from_buffers = graphs._forward(bucket)[:rows]  # what the bucket's graph replays
            hidden = triton_forward(model, ids, positions, eager_cache, metadata, kernels)
            eager = model.compute_logits(hidden)
        torch.testing.assert_close(from_buffers, eager, atol=1e-5, rtol=1e-5)
        # same K/V (up to matmul rounding at another row count); a padding row writing anywhere would differ by O(1)
        torch.testing.assert_close(graph_cache.storage, eager_cache.storage, atol=1e-5, rtol=1e-5)
    assert bucket == 4 and graphs.slot_mapping[3] == -1 and graphs.context_lens[3] == 1
    assert graphs.bucket_for(2, 2) is None  # nothing captured (no CUDA here): every step runs eagerly
