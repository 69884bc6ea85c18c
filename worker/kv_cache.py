"""The paged KV cache tensors (the worker owns them; the scheduler decides which page holds what)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.config import ModelConfig


@dataclass(slots=True)
class KVCache:
    # one tensor [2, num_layers, num_blocks, block_size, KVH, D]; the per-layer lists are views of it
    storage: torch.Tensor
    key_caches: list[torch.Tensor]  # per layer: [num_blocks, block_size, KVH, D]
    value_caches: list[torch.Tensor]  # per layer: [num_blocks, block_size, KVH, D]
    num_blocks: int
    block_size: int


def bytes_per_block(model_config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    """K and V for block_size tokens across all layers."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * model_config.head_dim * element_size


def num_blocks_for_budget(model_config: ModelConfig, dtype: torch.dtype, block_size: int, budget_bytes: int) -> int:
    """How many pages fit in budget_bytes; raises ValueError if not even one does."""
    per_block = bytes_per_block(model_config, dtype, block_size)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds no block: one block of {block_size} tokens "
            f"needs {per_block} bytes"
        )
    return int(num_blocks)


def allocate_kv_cache(
    model_config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> KVCache:
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must both be >= 1")
    # zeros, not empty: the decode gather reads padded (masked) slots, and a NaN bit pattern there
    # would still poison the output (0 * NaN = NaN)
    storage = torch.zeros(
        2,
        model_config.num_layers,
        num_blocks,
        block_size,
        model_config.num_kv_heads,
        model_config.head_dim,
        dtype=dtype,
        device=device,
    )
    return KVCache(
        storage=storage,
        key_caches=list(storage[0].unbind(0)),
        value_caches=list(storage[1].unbind(0)),
        num_blocks=num_blocks,
        block_size=block_size,
    )
