"""Which pages each request owns, under the `paged` or the `static` policy.

paged:  pages are taken as tokens arrive; full pages are shared through the prefix cache.
static: the first allocation reserves pages for prompt + max_tokens, the way servers without paging
        must; nothing more is ever needed, so a running request never waits for pages.
Both report KV utilization = live tokens / reserved slots.

With a swap tier (num_host_blocks > 0) a preempted request's computed pages may move to host pages
(swap_out) and come back into fresh device pages when it resumes (swap_in); the manager keeps both
tiers' tables and returns the page copies for the worker to make.
"""
from __future__ import annotations

from scheduler.block_pool import BlockPool
from core.prefix_keys import extend_block_hashes
from scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, policy: str, prefix_caching: bool,
                 num_host_blocks: int = 0) -> None:
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks)  # the swap tier; its pages carry no prefix keys
        self.host_tables: dict[str, list[int]] = {}  # swapped-out requests: their computed pages, in order
        self.block_size = block_size
        self.policy = policy
        self.prefix_caching = prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading pages of a request already in the index
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def blocks_needed_at_most(self, request: Request) -> int:
        return cdiv(request.num_prompt_tokens + request.sampling_params.max_tokens, self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Pages holding the longest cached prefix of the request's tokens.

        At least the last token is always left to compute: its logits are needed to sample.
        """
        if not self.prefix_caching:
            return []
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.num_known_tokens)
        hits = []
        for key in request.block_hashes:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        if hits and len(hits) * self.block_size >= request.num_tokens:
            hits.pop()
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: list[int] | tuple[int, ...] = ()) -> list[int] | None:
        """Pages so that the request can hold num_new_tokens more computed tokens (a swapped request
        gets all of its pages anew: call swap_in() after).

        Returns the newly added page ids (cached ones first), or None if the pool cannot supply
        them; on None nothing has changed.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        num_computed = len(cached_blocks) * self.block_size if cached_blocks else request.num_computed_tokens
        if self.policy == "static":
            wanted = max(self.blocks_needed_at_most(request), cdiv(num_computed + num_new_tokens, self.block_size))
        else:
            wanted = cdiv(num_computed + num_new_tokens, self.block_size)
        num_fresh = wanted - len(table) - len(cached_blocks)
        # cached pages that sit in the free queue stop being free when taken
        num_reclaimed = sum(1 for block_id in cached_blocks if self.pool.ref_counts[block_id] == 0)
        if max(num_fresh, 0) + num_reclaimed > self.pool.num_free:
            if not table:
                del self.block_tables[request.request_id]
            return None
        self.pool.take(cached_blocks)
        fresh = self.pool.allocate(max(num_fresh, 0)) or []
        added = list(cached_blocks) + fresh
        table.extend(added)
        if self.prefix_caching:
            self._register_full_blocks(request, table, num_computed + num_new_tokens)
        return added

    def _register_full_blocks(self, request: Request, table: list[int], num_tokens: int) -> None:
        # Registered as soon as the step that fills them is planned: the worker writes a step's K/V
        # before any attention of that step reads, so a request scheduled later in the same step may
        # already share them.
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, request.num_known_tokens)
        start = self._num_registered.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for index in range(start, end):
            self.pool.register(table[index], request.block_hashes[index])
        self._num_registered[request.request_id] = max(start, end)

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self.host_tables

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Moves the request's computed pages to host pages and frees its device pages: the
        (device, host) copies to make, or None (nothing changed) when the host tier lacks room."""
        num_pages = cdiv(request.num_computed_tokens, self.block_size)
        host_ids = self.host_pool.allocate(num_pages) if num_pages else None
        if host_ids is None:
            return None
        copies = list(zip(self.block_tables[request.request_id][:num_pages], host_ids))
        self._free_device(request)
        self.host_tables[request.request_id] = host_ids
        return copies

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """After allocate_slots gave a swapped request its device pages: the (device, host) copies that
        fill them, the host pages freed."""
        host_ids = self.host_tables.pop(request.request_id)
        self.host_pool.release(host_ids)
        return list(zip(self.block_tables[request.request_id], host_ids))

    def free(self, request: Request) -> None:
        self.host_pool.release(self.host_tables.pop(request.request_id, ()))
        self._free_device(request)

    def _free_device(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, [])
        num_registered = self._num_registered.pop(request.request_id, 0)
        # Pages registered for a step that will now never run (a preemption while planning it)
        # hold no K/V yet: forget their keys so no later request takes them as a prefix hit.
        for index in range(request.num_computed_tokens // self.block_size, num_registered):
            if self.pool.ref_counts[table[index]] == 1:
                self.pool.unregister(table[index])
        # tail pages first to the free queue, so they are evicted before the shared prefix pages
        self.pool.release(reversed(table))

    def forget_cached_content(self) -> None:
        """No page holds K/V any more (the worker was replaced): no prefix may hit them."""
        for block_id in range(self.pool.num_blocks):
            self.pool.unregister(block_id)

    def utilization(self, requests: list[Request]) -> float:
        """Live tokens / reserved slots over the given (running) requests; 0 with none."""
        reserved = sum(len(self.block_tables.get(r.request_id, ())) for r in requests) * self.block_size
        live = sum(r.num_computed_tokens for r in requests)
        return live / reserved if reserved else 0.0
