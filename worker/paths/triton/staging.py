"""CUDA only: step inputs go up through pinned buffers on a copy stream; sampled tokens come back the same way.

Up: a step's integer inputs (token ids, positions, slot mapping, query starts, context lengths, block
tables, and the placeholder rows with their sources, see below) are packed into one pinned int64
buffer and copied in one non-blocking H2D copy on a dedicated copy stream. stage() does this in
ModelRunner.prepare(): under async scheduling that is the RPC thread, while the compute thread runs
the step before, so the copy overlaps that step's kernels. take() (in run(), on the compute thread)
makes the compute stream wait on the copy's event, not the host, and builds the device views.

Slots: a ring of pinned + device buffers (SlotRing). A slot is handed out again only once the step that
last used it has released it (mark_consumed: its consumed event is recorded after the last kernel that
reads it); then the host waits for the copy out of its pinned half (the DMA may still read it) and the
copy stream waits for the compute that read its device half. A slot staged but not yet released (a
step prepared and not yet run, e.g. two prepared ahead, or one whose RPC was dropped) is never waited
for: the ring puts a fresh slot in its place, so prepare() never blocks on run().

Down: sampled token ids are copied into a pinned buffer with non_blocking=True and an event is
recorded; the host does its bookkeeping and only then waits on the event.

Nothing here but SlotRing is constructed on CPU; worker.paths.base resolves stream_overlap to False there.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Generic, Protocol, Sequence, TypeVar

import torch

from worker.paths.triton.forward import HostMetadata, KernelMetadata

NUM_SLOTS = 3  # one running, one prepared ahead, one spare


class _RingSlot(Protocol):
    capacity: int
    staged: bool  # handed to a step that has not released it yet
    used: bool  # released at least once: its copy and compute events have been recorded


S = TypeVar("S", bound=_RingSlot)


class SlotRing(Generic[S]):
    """The slot reuse rule, device-independent: round robin; a slot still held by a step, or too small,
    is replaced by a fresh one (make(capacity)) rather than waited for. Thread-safe."""

    def __init__(self, make: Callable[[int], S], num_slots: int, initial_capacity: int) -> None:
        self._make = make
        self.slots: list[S] = [make(initial_capacity) for _ in range(num_slots)]
        self._next = 0
        self._lock = threading.Lock()

    def take(self, numel: int) -> tuple[S, bool]:
        """-> (slot, reused): reused means the slot served an earlier step that released it, so its
        last copy and compute must be waited for; a fresh slot needs no wait."""
        with self._lock:
            index = self._next
            self._next = (index + 1) % len(self.slots)
            slot = self.slots[index]
            if slot.staged or numel > slot.capacity:
                # a held slot stays alive through the step that holds it and is freed with it
                capacity = max(numel, 2 * slot.capacity) if numel > slot.capacity else slot.capacity
                slot = self.slots[index] = self._make(capacity)
            reused = slot.used
            slot.staged = True
            return slot, reused

    def release(self, slot: S) -> None:
        with self._lock:
            slot.staged = False
            slot.used = True


class _Slot:
    def __init__(self, device: torch.device, capacity: int) -> None:
        self.capacity = capacity
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self.device = torch.empty(capacity, dtype=torch.int64, device=device)
        self.copied = torch.cuda.Event()  # the H2D copy out of `host` finished
        self.consumed = torch.cuda.Event()  # the compute that reads `device` finished
        self.staged = False
        self.used = False  # both events have been recorded at least once


@dataclass(slots=True)
class StagedStep:
    """A step's inputs on their way up; take() turns them into device views on the compute stream."""

    slot: _Slot
    sizes: list[int]  # lengths of the packed parts, in order
    num_rows: int
    max_blocks: int
    decode_only: bool
    num_placeholders: int


class StepStager:
    def __init__(self, device: torch.device, initial_capacity: int = 1 << 16) -> None:
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device)
        self.ring: SlotRing[_Slot] = SlotRing(lambda capacity: _Slot(device, capacity), NUM_SLOTS, initial_capacity)

    @property
    def slots(self) -> list[_Slot]:
        return self.ring.slots

    def stage(self, input_ids: Sequence[int], positions: Sequence[int], host: HostMetadata,
              placeholder_rows: Sequence[int] = (), placeholder_sources: Sequence[int] = ()) -> StagedStep:
        """Fills a pinned slot and starts its H2D copy on the copy stream; any thread. Touches no other stream."""
        num_tokens, num_rows = len(input_ids), len(host.context_lens)
        max_blocks = len(host.block_tables[0]) if host.block_tables else 0
        flat = [*input_ids, *positions, *host.slot_mapping, *host.query_start_loc, *host.context_lens]
        for table in host.block_tables:
            flat.extend(table)
        flat.extend(placeholder_rows)
        flat.extend(placeholder_sources)
        slot, reused = self.ring.take(len(flat))
        if reused:
            slot.copied.synchronize()  # the DMA may still read the pinned half
        slot.host.numpy()[: len(flat)] = flat  # numpy: no torch CPU op (and no OpenMP team) on the RPC thread
        with torch.cuda.stream(self.copy_stream):
            if reused:
                self.copy_stream.wait_event(slot.consumed)
            slot.device[: len(flat)].copy_(slot.host[: len(flat)], non_blocking=True)
            slot.copied.record(self.copy_stream)
        # freed on the compute stream's order; a step dropped unrun must not free it under the copy
        slot.device.record_stream(self.copy_stream)
        sizes = [num_tokens, num_tokens, num_tokens, num_rows + 1, num_rows, num_rows * max_blocks,
                 len(placeholder_rows), len(placeholder_sources)]
        return StagedStep(slot, sizes, num_rows, max_blocks, host.decode_only, len(placeholder_rows))

    def take(self, staged: StagedStep) -> tuple[torch.Tensor, torch.Tensor, KernelMetadata, torch.Tensor, torch.Tensor]:
        """On the compute thread: the current stream waits for the copy; -> (ids [T] int64, positions [T] int64,
        metadata, placeholder rows [P] int64, placeholder sources [P] int64), views into the slot."""
        torch.cuda.current_stream(self.device).wait_event(staged.slot.copied)
        ids, pos, slots, starts, context_lens, tables, rows, sources = staged.slot.device[: sum(staged.sizes)].split(staged.sizes)
        metadata = KernelMetadata(
            slot_mapping=slots,
            block_tables=tables.view(staged.num_rows, staged.max_blocks).to(torch.int32),
            query_start_loc=starts.to(torch.int32),
            context_lens=context_lens.to(torch.int32),
            decode_only=staged.decode_only,
        )
        return ids, pos, metadata, rows, sources

    def mark_consumed(self, staged: StagedStep) -> None:
        """Call after launching every kernel that reads the step's device buffers (on the compute thread)."""
        staged.slot.consumed.record(torch.cuda.current_stream(self.device))
        self.ring.release(staged.slot)


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
