"""A stand-in for the model that still checks page accounting end to end.

It keeps a fake KV cache (slot -> (position, token)) written through the plan's block tables, and
"samples" a token computed from what it reads back through those tables. Wrong pages, a bad prefix
hit or a lost block therefore change the output, the way they would with a real model. With a
sliding window it reads (and samples from) only the positions in the window of the token it samples,
as a model whose every layer slides would.
"""
from __future__ import annotations

from core.step import StepPlan, StepResult, TokenLogprobs

VOCAB = 1000


class FakeExecutor:
    def __init__(self, num_blocks: int, block_size: int, sliding_window: int | None = None) -> None:
        self.num_blocks = num_blocks
        self.sliding_window = sliding_window
        self.block_size = block_size
        self.slots: dict[int, tuple[int, int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.wants_logprobs: dict[str, bool] = {}
        self.plans: list[StepPlan] = []
        self.host_pages: dict[int, list[tuple[int, int] | None]] = {}  # the swap tier: host page -> its slots

    def _slot(self, request_id: str, position: int) -> int:
        table = self.tables[request_id]
        assert position // self.block_size < len(table), f"{request_id}: no page for position {position}"
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        for request_id in plan.finished_request_ids:
            for store in (self.tokens, self.tables, self.computed, self.wants_logprobs):
                store.pop(request_id, None)
        # the plan's page copies, before any write of the step, swap_out first (as the real worker)
        for device_block, host_block in plan.swap_out:
            self.host_pages[host_block] = [self.slots.get(device_block * self.block_size + offset)
                                           for offset in range(self.block_size)]
        for device_block, host_block in plan.swap_in:
            for offset, entry in enumerate(self.host_pages[host_block]):
                slot = device_block * self.block_size + offset
                if entry is None:
                    self.slots.pop(slot, None)
                else:
                    self.slots[slot] = entry
        for new in plan.new_requests:
            assert new.request_id not in self.tokens, f"{new.request_id} sent in full twice"
            self.tokens[new.request_id] = list(new.token_ids)
            self.tables[new.request_id] = list(new.block_ids)
            self.computed[new.request_id] = new.num_computed_tokens
            self.wants_logprobs[new.request_id] = new.sampling_params.logprobs is not None
        for cached in plan.cached_requests:
            assert self.computed[cached.request_id] == cached.num_computed_tokens
            table = self.tables[cached.request_id]
            assert cached.num_dropped_block_ids <= len(table)
            del table[len(table) - cached.num_dropped_block_ids:]
            table.extend(cached.new_block_ids)
        result = StepResult(step_id=plan.step_id)
        # all writes of the step land before any read, as in the real worker
        for request_id, count in plan.num_scheduled_tokens.items():
            start = self.computed[request_id]
            inputs = self.tokens[request_id] + plan.spec_token_ids.get(request_id, [])  # drafts after its tokens
            for position in range(start, start + count):
                self.slots[self._slot(request_id, position)] = (position, inputs[position])
        for request_id, count in plan.num_scheduled_tokens.items():
            drafts = plan.spec_token_ids.get(request_id)
            if drafts is not None:
                self._verify(request_id, drafts, result)
                continue
            self.computed[request_id] += count
            if self.computed[request_id] < len(self.tokens[request_id]):
                continue
            token = self._read_token(request_id, self.computed[request_id])
            self.tokens[request_id].append(token)
            result.sampled_token_ids[request_id] = token
            if self.wants_logprobs[request_id]:
                result.logprobs[request_id] = TokenLogprobs(logprob=-0.5)
        return result

    def _read_token(self, request_id: str, end: int) -> int:
        """The token after positions 0..end-1, from what the request's pages hold (next_token over them)."""
        start = 0 if self.sliding_window is None else max(0, end - self.sliding_window)
        seen = {p: self.slots.get(self._slot(request_id, p)) for p in range(start, end)}
        assert all(s is not None and s[0] == p for p, s in seen.items()), f"{request_id}: stale page"
        return sum((p + 1) * s[1] for p, s in seen.items()) % VOCAB

    def _verify(self, request_id: str, drafts: list[int], result: StepResult) -> None:
        """Speculative decoding, greedily: the drafts are accepted while each is the token the pages (which
        hold the drafts before it) give, then that position's own token follows."""
        tokens, start = self.tokens[request_id], self.computed[request_id]
        assert len(tokens) == start + 1, f"{request_id}: drafts must follow exactly one uncomputed token"
        accepted = []
        for draft in [*drafts, None]:
            token = self._read_token(request_id, start + 1 + len(accepted))
            if token != draft:
                break
            accepted.append(token)
        tokens.extend([*accepted, token])
        self.computed[request_id] = start + 1 + len(accepted)
        result.sampled_token_ids[request_id] = token
        result.accepted_token_ids[request_id] = accepted


def next_token(tokens: list[int], sliding_window: int | None = None) -> int:
    """What FakeExecutor samples after tokens (all of them in the cache, each at its own position)."""
    start = 0 if sliding_window is None else max(0, len(tokens) - sliding_window)
    return sum((p + 1) * tokens[p] for p in range(start, len(tokens))) % VOCAB
