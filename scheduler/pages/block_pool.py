"""KV pages with reference counts, an LRU free queue and the prefix-cache index.

A page with ref count 0 sits in the free queue but keeps its content key, so a later request with the
same prefix can take it back (a prefix hit) until allocation evicts it, oldest first.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Iterable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_keys: list[bytes | None] = [None] * num_blocks
        # block id -> None; first = least recently freed = next to evict
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # content key -> block id

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def next_to_evict(self, count: int) -> list[int]:
        """The free pages allocate(count) would take, in order (their keys are about to be dropped)."""
        return list(itertools.islice(self._free, count))

    def allocate(self, count: int) -> list[int] | None:
        """count fresh pages with ref count 1, or None when there are not enough (never raises)."""
        if count > len(self._free):
            return None
        block_ids = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self.unregister(block_id)  # evicts its old content from the prefix index
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def take(self, block_ids: Iterable[int]) -> None:
        """Adds an owner to cached pages (prefix hits), pulling free ones out of the free queue."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drops one owner; pages reaching 0 go to the back of the free queue, content kept."""
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} released more often than taken"
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None

    def unregister(self, block_id: int) -> None:
        key = self.block_keys[block_id]
        if key is not None:
            self.block_keys[block_id] = None
            if self._cached.get(key) == block_id:
                del self._cached[key]

    def cached_keys(self) -> set[bytes]:
        """A snapshot of the content keys findable now (published to Redis by scheduler/process/load_report.py)."""
        return set(self._cached)

    def lookup(self, key: bytes) -> int | None:
        return self._cached.get(key)

    def register(self, block_id: int, key: bytes) -> None:
        """Makes a full page findable by its content key; a key already held by another page wins."""
        if self.block_keys[block_id] is None and key not in self._cached:
            self._cached[key] = block_id
            self.block_keys[block_id] = key
