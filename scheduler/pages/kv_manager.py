"""Which pages each request owns, under the `paged` or the `static` policy.

paged:  pages are taken as tokens arrive; full pages are shared through the prefix cache.
static: the first allocation reserves pages for prompt + max_tokens, the way servers without paging
        must; nothing more is ever needed, so a running request never waits for pages.
Both report KV utilization = live tokens / reserved slots.

With a swap tier (num_host_blocks > 0) a preempted request's computed pages may move to host pages
(swap_out) and come back into fresh device pages when it resumes (swap_in); the manager keeps both
tiers' tables and collects the page copies for the worker to make, in the order they were decided
(take_copies()). Prefix pages the device evicts are copied to free host pages first and stay findable
there (the host pool's own prefix index, evicted oldest first, by swapped requests too); a prefix hit
in the host tier comes back into a device page. Host pages that pending swap_in copies read stay
taken until the plan carrying those copies is sent (take_copies()), so no swap_out of that plan,
which the worker runs first, overwrites them.

Sliding window (sliding_window set: every layer of the model attends only the last `window`
positions): before a running request gets more pages, its leading pages that hold only positions
before the window of its next token go back to the pool (no later token of it attends to them). They
keep their place in its table as FREED_BLOCK_ID, so later pages keep their indices; their content
stays findable as a prefix like any freed page, until allocation evicts (unregisters) them. A model
with any full-attention layer (gemma's global layers, qwen2's layers below max_window_layers) keeps
every page: such a layer still reads them all.
"""
from __future__ import annotations

from typing import Protocol

from core.prefix_keys import extend_block_hashes
from core.sampling import SamplingParams
from core.step import FREED_BLOCK_ID
from scheduler.pages.block_pool import BlockPool


class PagedRequest(Protocol):
    """What page accounting reads of a request (scheduler.request.Request is one): the page room
    imports nothing of the scheduling rule."""

    request_id: str
    sampling_params: SamplingParams  # max_tokens: what the static policy reserves
    all_token_ids: list[int]
    num_computed_tokens: int
    block_hashes: list[bytes]  # extended here as its pages fill (core.prefix_keys)

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_known_tokens(self) -> int: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, policy: str, prefix_caching: bool,
                 num_host_blocks: int = 0, sliding_window: int | None = None) -> None:
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks)  # the swap tier; its pages carry no prefix keys
        self.host_tables: dict[str, list[int]] = {}  # swapped-out requests: their computed pages, in order
        # (device, host) copies decided since the last plan was sent, in decision order
        self.swap_out_copies: list[tuple[int, int]] = []
        self.swap_in_copies: list[tuple[int, int]] = []
        self.host_reads: list[int] = []  # host pages the pending swap_in copies read: taken until sent
        self._pending_fill: set[int] = set()  # device pages the pending swap_in copies write
        self.host_prefix_hits = 0  # prompt tokens found in the host tier
        self.block_size = block_size
        self.policy = policy
        self.prefix_caching = prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        # static reserves everything up front and keeps it: nothing to give back
        self.sliding_window = sliding_window if policy == "paged" else None
        self._num_freed: dict[str, int] = {}  # leading pages of a request given back (FREED_BLOCK_ID in its table)
        self._num_registered: dict[str, int] = {}  # leading pages of a request already in the index
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def live_block_ids(self, request_id: str) -> list[int]:
        """The pages the request holds: its table less the leading ones it gave back."""
        return self.block_table(request_id)[self._num_freed.get(request_id, 0):]

    def _num_dead_pages(self, num_computed_tokens: int) -> int:
        """Leading pages no later token reads: the next one, at position num_computed_tokens, attends to
        positions > num_computed_tokens - window (transformers' rule: query - key < window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    def _free_outside_window(self, request: PagedRequest, table: list[int]) -> None:
        # num_computed_tokens counts steps already sent (async scheduling: not yet run). A page freed
        # here is written by another request at the earliest in the step being planned, which the
        # worker runs after those (copies included), so their reads of it are done by then.
        start = self._num_freed.get(request.request_id, 0)
        end = min(self._num_dead_pages(request.num_computed_tokens), len(table))
        if end <= start:
            return
        dead = table[start:end]
        table[start:end] = [FREED_BLOCK_ID] * (end - start)
        self._num_freed[request.request_id] = end
        self.pool.release(dead)

    def blocks_needed_at_most(self, request: PagedRequest) -> int:
        return cdiv(request.num_prompt_tokens + request.sampling_params.max_tokens, self.block_size)

    def find_cached_prefix(self, request: PagedRequest) -> list[int]:
        """Pages holding the longest cached prefix of the request's tokens.

        At least the last token is always left to compute: its logits are needed to sample.
        """
        if not self.prefix_caching:
            return []
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.num_known_tokens)
        hits = []
        for key in request.block_hashes:
            block_id = self.pool.lookup(key)
            if block_id is None and self.host_pool.lookup(key) is not None:
                self.pool.take(hits)  # pinned: the page allocated for the host copy must not evict them
                block_id = self._from_host(key)
                self.pool.release(hits)
            if block_id is None:
                break
            hits.append(block_id)
        if hits and len(hits) * self.block_size >= request.num_tokens:
            hits.pop()
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits

    def _from_host(self, key: bytes) -> int | None:
        """A device page holding the host tier's copy of key (free, findable), or None."""
        host_id = self.host_pool.lookup(key)
        if host_id is None or not self.pool.num_free:
            return None
        self.host_pool.take([host_id])  # read by a pending swap_in: not reused before it is sent
        self.host_reads.append(host_id)
        block_id = self._allocate_device(1)[0]
        self.swap_in_copies.append((block_id, host_id))
        self._pending_fill.add(block_id)
        self.pool.register(block_id, key)
        self.pool.release([block_id])  # free and findable: allocate_slots takes it like any cached page
        self.host_prefix_hits += self.block_size
        return block_id

    def _allocate_device(self, count: int) -> list[int] | None:
        """pool.allocate(), first copying the prefix pages it evicts to free host pages."""
        if self.host_pool.num_blocks and self.prefix_caching:
            for block_id in self.pool.next_to_evict(count):
                key = self.pool.block_keys[block_id]
                if key is None or self.host_pool.lookup(key) is not None or block_id in self._pending_fill:
                    continue  # no content, already kept, or its content has not arrived yet
                host_ids = self.host_pool.allocate(1)
                if host_ids is None:
                    break  # every host page is a swapped request's or read this plan
                self.host_pool.register(host_ids[0], key)
                self.host_pool.release(host_ids)  # cached: free, findable, evicted oldest first
                self.swap_out_copies.append((block_id, host_ids[0]))
        return self.pool.allocate(count)

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies for the plan being sent (swap_out, swap_in); after it the host pages they read may
        be reused, since any later swap_out runs in a later plan."""
        copies = self.swap_out_copies, self.swap_in_copies
        self.swap_out_copies, self.swap_in_copies = [], []
        self.host_pool.release(self.host_reads)
        self.host_reads = []
        self._pending_fill.clear()
        return copies

    def allocate_slots(self, request: PagedRequest, num_new_tokens: int,
                       cached_blocks: list[int] | tuple[int, ...] = ()) -> list[int] | None:
        """Pages so that the request can hold num_new_tokens more computed tokens (a swapped request
        gets all of its pages anew: call swap_in() after).

        Returns the newly added page ids (cached ones first), or None if the pool cannot supply
        them; on None nothing has changed but pages outside a sliding window given back.
        """
        table = self.block_tables.get(request.request_id)
        if table and not cached_blocks and self.sliding_window is None and self.policy != "static":
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(table) * self.block_size:  # a decode step inside its last page: most steps
                if self.prefix_caching and num_tokens // self.block_size > self._num_registered.get(request.request_id, 0):
                    self._register_full_blocks(request, table, num_tokens)
                return []
        if table is None:
            table = self.block_tables[request.request_id] = []
        num_computed = len(cached_blocks) * self.block_size if cached_blocks else request.num_computed_tokens
        starts_table = not table
        if table:
            self._free_outside_window(request, table)
        elif self.is_swapped(request.request_id):  # the pages it gave back were not swapped out either
            num_dead = self._num_dead_pages(num_computed)
            table.extend([FREED_BLOCK_ID] * num_dead)
            self._num_freed[request.request_id] = num_dead
        if self.policy == "static":
            wanted = max(self.blocks_needed_at_most(request), cdiv(num_computed + num_new_tokens, self.block_size))
        else:
            wanted = cdiv(num_computed + num_new_tokens, self.block_size)
        num_fresh = wanted - len(table) - len(cached_blocks)
        # cached pages that sit in the free queue stop being free when taken
        num_reclaimed = sum(1 for block_id in cached_blocks if self.pool.ref_counts[block_id] == 0)
        if max(num_fresh, 0) + num_reclaimed > self.pool.num_free:
            if starts_table:
                del self.block_tables[request.request_id]
                self._num_freed.pop(request.request_id, None)
            return None
        self.pool.take(cached_blocks)
        fresh = self._allocate_device(max(num_fresh, 0)) or []
        added = list(cached_blocks) + fresh
        table.extend(added)
        if self.prefix_caching:
            self._register_full_blocks(request, table, num_computed + num_new_tokens)
        return added

    def _register_full_blocks(self, request: PagedRequest, table: list[int], num_tokens: int) -> None:
        # Registered as soon as the step that fills them is planned: the worker writes a step's K/V
        # before any attention of that step reads, so a request scheduled later in the same step may
        # already share them.
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.num_known_tokens)
        # pages given back before their keys were known (async placeholders) stay unregistered
        start = max(self._num_registered.get(request.request_id, 0), self._num_freed.get(request.request_id, 0))
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for index in range(start, end):
            self.pool.register(table[index], request.block_hashes[index])
        self._num_registered[request.request_id] = max(start, end)

    def free_tail(self, request: PagedRequest) -> int:
        """Gives back the pages past the ones its tokens need (speculative decoding: draft tokens the worker
        rejected wrote the rest, and no later step reads them); returns how many, for the worker's copy of
        the table. Such pages never entered the prefix index: only full pages of known tokens do. The
        static policy keeps its reservation."""
        table = self.block_tables.get(request.request_id)
        keep = cdiv(request.num_tokens, self.block_size)
        if self.policy == "static" or table is None or len(table) <= keep:
            return 0
        tail = table[keep:]
        del table[keep:]
        self.pool.release(reversed(tail))
        return len(tail)

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.host_tables

    def swap_out(self, request: PagedRequest) -> bool:
        """Moves the request's computed pages to host pages (copies queued) and frees its device pages;
        False (nothing changed but pages outside a sliding window given back) when the host tier lacks room."""
        table = self.block_tables[request.request_id]
        self._free_outside_window(request, table)  # what swap_in leaves out, it must not copy
        num_freed = self._num_freed.get(request.request_id, 0)
        num_pages = cdiv(request.num_computed_tokens, self.block_size) - num_freed
        host_ids = self.host_pool.allocate(num_pages) if num_pages else None
        if host_ids is None:
            return False
        self.swap_out_copies.extend(zip(table[num_freed:num_freed + num_pages], host_ids))
        self._free_device(request)
        self.host_tables[request.request_id] = host_ids
        return True

    def swap_in(self, request: PagedRequest) -> None:
        """After allocate_slots gave a swapped request its device pages: queues the copies that fill
        them; its host pages are freed once those are sent."""
        host_ids = self.host_tables.pop(request.request_id)
        self.host_reads.extend(host_ids)
        copies = list(zip(self.live_block_ids(request.request_id), host_ids))
        self.swap_in_copies.extend(copies)
        self._pending_fill.update(device_id for device_id, _ in copies)

    def free(self, request: PagedRequest) -> None:
        self.host_pool.release(self.host_tables.pop(request.request_id, ()))
        self._free_device(request)

    def _free_device(self, request: PagedRequest) -> None:
        table = self.block_tables.pop(request.request_id, [])
        num_freed = self._num_freed.pop(request.request_id, 0)
        num_registered = self._num_registered.pop(request.request_id, 0)
        # Pages registered for a step that will now never run (a preemption while planning it)
        # hold no K/V yet: forget their keys so no later request takes them as a prefix hit.
        for index in range(request.num_computed_tokens // self.block_size, num_registered):
            if self.pool.ref_counts[table[index]] == 1:
                self.pool.unregister(table[index])
        # tail pages first to the free queue, so they are evicted before the shared prefix pages
        self.pool.release(reversed(table[num_freed:]))

    def forget_cached_content(self) -> None:
        """No page holds K/V any more (the worker was replaced, host tier too): no prefix may hit them,
        and copies not yet sent are void."""
        for block_id in range(self.pool.num_blocks):
            self.pool.unregister(block_id)
        for block_id in range(self.host_pool.num_blocks):
            self.host_pool.unregister(block_id)
        self.take_copies()

    def resize(self, num_blocks: int, num_host_blocks: int) -> None:
        """Empty pools of the given sizes, for a worker that came back with another KV cache: no page id
        of the old pools survives, so none can be planned. No request may hold a page (free them first)."""
        if self.block_tables or self.host_tables:
            raise RuntimeError(f"the KV pools cannot be resized while {len(self.block_tables)} requests hold "
                               f"device pages and {len(self.host_tables)} host pages")
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks)
        self.take_copies()

    def utilization(self, requests: list[PagedRequest]) -> float:
        """Live tokens / reserved slots over the given (running) requests; 0 with none."""
        reserved = sum(len(self.live_block_ids(r.request_id)) for r in requests) * self.block_size
        live = sum(r.num_computed_tokens - self._num_freed.get(r.request_id, 0) * self.block_size for r in requests)
        return live / reserved if reserved else 0.0
