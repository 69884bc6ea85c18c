"""A tiny model's greedy run over a paged KV cache, whole or split over ranks (tests/worker/parallel)."""
from __future__ import annotations

from pathlib import Path

import torch

from worker.linears.ggml_blocks import BLOCK_TYPES
from worker.linears.group_quant import quantize_linears
from worker.loader import load_model
from worker.model.attention import build_attention_metadata
from worker.paths.triton.forward import build_kernel_metadata, load_kernels, triton_forward
from worker.model.kv_cache import allocate_kv_cache
from worker.parallel.group import SINGLE_RANK, TensorParallelGroup, join_group, leave_group
from worker.parallel.ranks import Parallel
from worker.step_batch import RequestSpan

BLOCK_SIZE = 4
PROMPTS = ([5, 17, 99, 3, 250, 8, 41, 77, 12, 200, 64], [9, 130, 31, 2, 180, 44, 7])  # two lengths, one batch
DECODE_STEPS = 6


# how greedy_run loads the model: a folder's floats, a tensor-parallel rank reading only its share (as the worker
# does: worker.build), or the whole model split after loading (as for a GGUF file's floats); a GGUF file's weights
# on their blocks, or converted to group-quantized codes; a folder's floats quantized to int4 after the split
WEIGHTS = ("float", "float-whole", "blocks", "converted", "int4")


def load_weights(path: Path, weights: str):
    if weights in ("float", "float-whole", "int4"):
        return load_model(path, dtype=torch.float32, progress=False)
    return load_model(path, dtype=torch.float32, progress=False, keep_quantized=True,
                      block_types=BLOCK_TYPES if weights == "blocks" else ())


def load_share(path: Path, weights: str, parallel: Parallel):
    """(this rank's share, the whole model's config): the share read as such from a folder (weights "float", tensor split), else split after loading."""
    share_of = parallel.share_of(path) if weights == "float" else None
    if share_of is None:
        whole, config = load_weights(path, weights)
        return parallel.split(whole), config
    share, config = load_model(path, dtype=torch.float32, progress=False, share_of=share_of)
    return parallel.wrap(share, config), config


def greedy_run(folder: Path, group: TensorParallelGroup = SINGLE_RANK, pipeline: bool = False,
               kv_dtype: torch.dtype = torch.float32, weights: str = "float",
               triton: bool = False) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill both prompts in one packed step, then DECODE_STEPS batched greedy steps: every step's logits
    [rows, vocab] (all prompt rows, then one row per request) and each request's generated tokens (split by
    heads over the group, or by layers with pipeline). kv_dtype: the pages' (int8 / float8: quantized pages);
    weights: one of WEIGHTS; triton: the Triton path's forward instead of the modules'."""
    parallel = Parallel(group, channel=None, pipeline=pipeline)
    model, config = load_weights(folder, weights) if group.world_size == 1 else load_share(folder, weights, parallel)
    if weights == "int4":
        quantize_linears(model, bits=4)
    rank_config = parallel.kv_config(config) if group.world_size > 1 else config
    blocks_per_request = 8
    kv_cache = allocate_kv_cache(rank_config, 2 * blocks_per_request, BLOCK_SIZE, kv_dtype)
    # non-contiguous, interleaved pages: the block tables matter
    tables = [list(range(0, 2 * blocks_per_request, 2)), list(range(1, 2 * blocks_per_request, 2))]
    sequences = [list(prompt) for prompt in PROMPTS]
    all_logits = []
    with torch.no_grad():
        chunks = [list(prompt) for prompt in PROMPTS]
        for _ in range(DECODE_STEPS + 1):
            input_ids, positions, spans, last_rows = [], [], [], []
            for sequence, chunk, table in zip(sequences, chunks, tables):
                start = len(sequence) - len(chunk)
                spans.append(RequestSpan(len(input_ids), len(chunk), len(sequence), table))
                input_ids += chunk
                positions += range(start, len(sequence))
                last_rows.append(len(input_ids) - 1)
            if triton:  # the Triton path's forward (interpreted on CPU), all-reducing a share's branches
                metadata = build_kernel_metadata(spans, BLOCK_SIZE, "cpu")
                hidden = triton_forward(model, torch.tensor(input_ids), torch.tensor(positions), kv_cache, metadata,
                                        load_kernels())
            else:
                metadata = build_attention_metadata(spans, BLOCK_SIZE)
                hidden = model(torch.tensor(input_ids), torch.tensor(positions), kv_cache, metadata)
            logits = model.compute_logits(hidden)
            all_logits.append(logits)
            next_tokens = logits[last_rows].argmax(dim=-1).tolist()
            for sequence, token in zip(sequences, next_tokens):
                sequence.append(token)
            chunks = [[token] for token in next_tokens]
    return all_logits, [sequence[len(prompt):] for sequence, prompt in zip(sequences, PROMPTS)]


def rank_main(rank: int, world_size: int, init_method: str, folder: str, out: str, pipeline: bool = False,
              kv_dtype: torch.dtype = torch.float32, weights: str = "float", triton: bool = False) -> None:
    """One rank of a spawned group: rank 0 saves the logits and tokens it ends up with to `out`."""
    torch.set_num_threads(1)
    group = join_group(rank, world_size, init_method, timeout_s=60)
    try:
        logits, tokens = greedy_run(Path(folder), group, pipeline, kv_dtype, weights, triton)
        if rank == 0:
            torch.save({"logits": logits, "tokens": tokens}, out)
    finally:
        leave_group(group)
