"""The paged KV cache tensors (the worker owns them; the scheduler decides which page holds what)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.model.config import ModelConfig
from worker.model.kv_quant import SCALE_DTYPE, is_quantized


@dataclass(slots=True)
class KVCache:
    # one tensor [2, num_layers, num_blocks, block_size, KVH, D]; the per-layer lists are views of it
    storage: torch.Tensor
    key_caches: list[torch.Tensor]  # per layer: [num_blocks, block_size, KVH, D]
    value_caches: list[torch.Tensor]  # per layer: [num_blocks, block_size, KVH, D]
    num_blocks: int
    block_size: int
    # quantized pages (worker.model.kv_quant): [2, num_layers, num_blocks, block_size, KVH] float16, allocated
    # once beside storage (a static buffer for CUDA graphs); None: the pages hold floats
    scales: torch.Tensor | None = None

    def layer_scales(self) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer: (key_scales, value_scales) [num_blocks, block_size, KVH], or None for float pages."""
        if self.scales is None:
            return [None] * len(self.key_caches)
        return list(zip(self.scales[0].unbind(0), self.scales[1].unbind(0)))

    @property
    def bytes_per_block(self) -> int:
        """K and V of one page across all layers, scales included (what a page swap moves)."""
        scale_bytes = 0 if self.scales is None else self.scales[:, :, 0].nbytes
        return self.storage[:, :, 0].nbytes + scale_bytes


def bytes_per_block(model_config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    """K and V for block_size tokens across all layers; dtype is the pages' storage dtype (with int8 / float8
    pages, their float16 scale per token and KV head counts too)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    row_bytes = model_config.head_dim * element_size
    if is_quantized(dtype):
        row_bytes += torch.empty((), dtype=SCALE_DTYPE).element_size()
    return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * row_bytes


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
    scales = None
    if is_quantized(dtype):  # zeros too: a masked slot dequantizes to 0 * 0
        scales = torch.zeros(storage.shape[:-1], dtype=SCALE_DTYPE, device=device)
    return KVCache(
        storage=storage,
        key_caches=list(storage[0].unbind(0)),
        value_caches=list(storage[1].unbind(0)),
        num_blocks=num_blocks,
        block_size=block_size,
        scales=scales,
    )


class HostSwapSpace:
    """The host-memory tier: num_host_blocks pages beside the device cache, and the copies between them.

    Host pages are laid out [num_host_blocks, 2, num_layers, block_size, KVH, D], one contiguous run
    per page, pinned on CUDA so copies are DMA transfers; quantized pages' scales travel with them, in
    [num_host_blocks, 2, num_layers, block_size, KVH] (a page's values are meaningless without them). On CUDA they go on their own stream: it waits
    for the compute work queued so far (earlier steps' K/V writes), and the step's compute waits for it.
    The scheduler decides every copy; this only executes them (swap_out before swap_in).
    """

    def __init__(self, kv_cache: KVCache, num_host_blocks: int) -> None:
        device_storage = kv_cache.storage
        self.kv_cache = kv_cache
        self.num_host_blocks = num_host_blocks
        on_cuda = device_storage.device.type == "cuda"
        shape = (num_host_blocks, 2, device_storage.shape[1], *device_storage.shape[3:])
        pinned = on_cuda and num_host_blocks > 0
        self.storage = torch.zeros(shape, dtype=device_storage.dtype, pin_memory=pinned)
        self.scales = None
        if kv_cache.scales is not None:
            self.scales = torch.zeros(shape[:-1], dtype=kv_cache.scales.dtype, pin_memory=pinned)
        self.copy_stream = torch.cuda.Stream(device_storage.device) if on_cuda and num_host_blocks else None

    def copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """swap_out: (device, host) pages copied to the host; then swap_in: (device, host) pages copied back."""
        if not swap_out and not swap_in:
            return
        if self.copy_stream is None:
            self._copy(swap_out, swap_in, non_blocking=False)
            return
        compute_stream = torch.cuda.current_stream(self.copy_stream.device)
        self.copy_stream.wait_stream(compute_stream)
        with torch.cuda.stream(self.copy_stream):
            self._copy(swap_out, swap_in, non_blocking=True)
        compute_stream.wait_stream(self.copy_stream)

    def _copy(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]], non_blocking: bool) -> None:
        # [2, L, num_blocks, bs, KVH, D] pages, and [2, L, num_blocks, bs, KVH] scales where they are quantized
        pairs = [(self.kv_cache.storage, self.storage)]
        if self.scales is not None:
            pairs.append((self.kv_cache.scales, self.scales))
        for device_tensor, host_tensor in pairs:
            for device_block_id, host_block_id in swap_out:
                host_tensor[host_block_id].copy_(device_tensor[:, :, device_block_id], non_blocking=non_blocking)
        # swap_in after swap_out on one stream: a page swapped out and back in within a plan reads what landed
        for device_tensor, host_tensor in pairs:
            for device_block_id, host_block_id in swap_in:
                device_tensor[:, :, device_block_id].copy_(host_tensor[host_block_id], non_blocking=non_blocking)


def num_host_blocks_for(swap_space_bytes: int, model_config: ModelConfig, dtype: torch.dtype, block_size: int) -> int:
    """Host pages that fit in swap_space_bytes (0 when none do: no swap tier)."""
    return swap_space_bytes // bytes_per_block(model_config, dtype, block_size)
