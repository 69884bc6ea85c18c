"""CUDA only: step inputs go up through pinned buffers on a copy stream; sampled tokens come back the same way.

Up: a step's integer inputs (token ids, positions, slot mapping, query starts, context lengths, block
tables) are packed into one pinned int64 buffer and copied in one non-blocking H2D copy on a
dedicated copy stream, so the copy does not queue behind the compute stream's work; the compute
stream waits on the copy's event, not the host. Two slots alternate: while step N's kernels still
read slot A's device buffer, step N+1 is packed into slot B. A slot is reused only after the copy
that last read its pinned half finished (host waits on that event) and the compute that last read its
device half finished (the copy stream waits on that event).

Down: sampled token ids are copied into a pinned buffer with non_blocking=True and an event is
recorded; the host does its bookkeeping and only then waits on the event.

Nothing here is constructed on CPU; worker.backends resolves stream_overlap to False there.
"""
from __future__ import annotations

from typing import Sequence

import torch

from worker.triton_forward import HostMetadata, KernelMetadata

NUM_SLOTS = 2


class _Slot:
    def __init__(self, device: torch.device, capacity: int) -> None:
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.device = torch.empty(capacity, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event()  # the H2D copy out of `host` finished
        self.consumed = torch.cuda.Event()  # the compute that reads `device` finished
        self.in_use = False  # both events have been recorded at least once


class StepStager:
    def __init__(self, device: torch.device, initial_capacity: int = 1 << 16) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device)
        self.slots = [_Slot(device, initial_capacity) for _ in range(NUM_SLOTS)]
        self._next = 0
        self._current: _Slot | None = None

    def stage(
        self, input_ids: Sequence[int], positions: Sequence[int], host: HostMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, KernelMetadata]:
        """Starts the copy and makes the current stream wait for it; returns device views (int64 / int32)."""
        num_tokens, num_rows = len(input_ids), len(host.context_lens)
        max_blocks = len(host.block_tables[0]) if host.block_tables else 0
        flat = [*input_ids, *positions, *host.slot_mapping, *host.query_start_loc, *host.context_lens]
        for table in host.block_tables:
            flat.extend(table)
        slot = self._take_slot(len(flat))
        slot.host[: len(flat)].copy_(torch.tensor(flat, dtype=torch.int64))
        compute_stream = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.copy_stream):
            if slot.in_use:
                self.copy_stream.wait_event(slot.consumed)
            slot.device[: len(flat)].copy_(slot.host[: len(flat)], non_blocking=True)
            slot.copied.record(self.copy_stream)
        compute_stream.wait_event(slot.copied)
        parts = slot.device[: len(flat)].split(
            [num_tokens, num_tokens, num_tokens, num_rows + 1, num_rows, num_rows * max_blocks])
        ids, pos, slots, starts, context_lens, tables = parts
        metadata = KernelMetadata(
            slot_mapping=slots,
            block_tables=tables.view(num_rows, max_blocks).to(torch.int32),
            query_start_loc=starts.to(torch.int32),
            context_lens=context_lens.to(torch.int32),
            decode_only=host.decode_only,
        )
        self._current = slot
        return ids, pos, metadata

    def mark_consumed(self) -> None:
        """Call after launching every kernel that reads the last staged step's device buffers."""
        if self._current is not None:
            self._current.consumed.record(torch.cuda.current_stream(self.device))
            self._current.in_use = True
            self._current = None

    def _take_slot(self, numel: int) -> _Slot:
        index = self._next
        self._next = (self._next + 1) % NUM_SLOTS
        slot = self.slots[index]
        if slot.in_use:
            slot.copied.synchronize()  # the DMA may still read the pinned half
        if numel > slot.host.numel():
            if slot.in_use:
                slot.consumed.synchronize()  # the old device buffer is freed below
            slot = self.slots[index] = _Slot(self.device, max(numel, 2 * slot.host.numel()))
        return slot


class TokenReadback:
    """Sampled token ids [R] int64 on the device -> a host list, through a pinned buffer and an event."""

    def __init__(self, device: torch.device, capacity: int = 1024) -> None:
        self.device = device
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.ready = torch.cuda.Event()
        self._count = 0

    def start(self, token_ids: torch.Tensor) -> None:
        count = token_ids.shape[0]
        if count > self.host.numel():
            self.ready.synchronize()  # the old buffer may still be a copy target
            self.host = torch.empty(max(count, 2 * self.host.numel()), dtype=torch.int64, pin_memory=True)
        self.host[:count].copy_(token_ids, non_blocking=True)
        self.ready.record(torch.cuda.current_stream(self.device))
        self._count = count

    def finish(self) -> list[int]:
        self.ready.synchronize()
        return self.host[: self._count].tolist()
