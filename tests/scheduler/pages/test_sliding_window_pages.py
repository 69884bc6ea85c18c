"""Sliding window (every layer attends only the last `window` positions): a running request gives its
pages that lie wholly before its window back to the pool. The fake model reads only the window, and
every token it samples depends on what it reads there, so a page given back too early (and reused)
changes the output; the reference is the same fake model with every page kept."""
from __future__ import annotations

import pytest

from scheduler.config import SchedulerConfig
from scheduler.engine import EngineCore
from scheduler.scheduler import Scheduler
from tests.helpers.fake_executor import FakeExecutor
from tests.scheduler.conftest import make_request

WINDOW = 7
BLOCK_SIZE = 4
# prompts sharing a 9-token prefix in pairs, so prefix hits land on pages that windows give back
PROMPTS = [[1 + i // 2] * 9 + [20 + i] * (3 + 2 * i) for i in range(8)]


def windowed_engine(num_blocks: int, free_pages: bool = True, async_scheduling: bool = False, window: int = WINDOW,
                    **config) -> EngineCore:
    """The fake model always slides; free_pages=False is a scheduler that keeps every page."""
    scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=32,
                                          sliding_window=window if free_pages else None, **config))
    return EngineCore(scheduler, FakeExecutor(num_blocks, BLOCK_SIZE, window), async_scheduling=async_scheduling)


def run(engine: EngineCore, max_tokens: int = 20) -> dict[str, list[int]]:
    requests = [make_request(prompt, max_tokens=max_tokens, request_id=f"q{i}") for i, prompt in enumerate(PROMPTS)]
    engine.run_to_completion(requests)
    return {request.request_id: request.output_token_ids for request in requests}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_long_generation_holds_only_its_window(async_scheduling):
    expected_engine = windowed_engine(256, free_pages=False, async_scheduling=async_scheduling)
    expected = expected_engine.run_to_completion([make_request([3, 1, 4, 1, 5], max_tokens=80, request_id="long")])
    engine = windowed_engine(256, async_scheduling=async_scheduling)
    request = make_request([3, 1, 4, 1, 5], max_tokens=80, request_id="long")
    engine.add_request(request)
    pages_held = []
    while engine.has_unfinished():
        engine.step()
        pages_held.append(engine.scheduler.kv.pool.num_used)
    assert request.output_token_ids == [t for out in expected["long"] for t in out.new_token_ids]
    # 85 tokens would need 22 pages; the window (7 tokens) spans at most 3 pages, plus the one being filled
    assert max(pages_held) == -(-WINDOW // BLOCK_SIZE) + 1
    assert max(engine.kv_utilization_samples) <= 1.0  # tokens given back count as neither live nor reserved
    assert engine.scheduler.kv.pool.num_free == 256


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("num_host_blocks", [0, 64])
def test_same_output_under_page_pressure_with_prefix_hits_and_preemption(async_scheduling, num_host_blocks):
    """A pool too small for the 8 requests at once (each still fits it alone: the admission check counts
    prompt + max_tokens as if every page were kept): preemption (recompute, or swap with a host
    tier) still happens, prefix hits land on pages that other requests' windows gave back."""
    expected = run(windowed_engine(512, free_pages=False))
    engine = windowed_engine(12, async_scheduling=async_scheduling, num_host_blocks=num_host_blocks)
    assert run(engine) == expected
    scheduler = engine.scheduler
    assert scheduler.num_preemptions > 0
    if num_host_blocks:
        assert scheduler.num_swapped_preemptions > 0
        # a swapped request resumes past its window: its table starts with pages it gave back
        resumed = [new for plan in engine.executor.plans for new in plan.new_requests
                   if new.num_computed_tokens >= WINDOW + 2 * BLOCK_SIZE]
        assert resumed and plan_swaps_in_only_live_pages(engine)
    assert scheduler.kv.prefix_hits > 0
    assert scheduler.kv.pool.num_free == 12 and scheduler.kv.host_pool.num_free == num_host_blocks


def plan_swaps_in_only_live_pages(engine: EngineCore) -> bool:
    # each resumed request gets as many pages copied in as its window needs, never its whole history
    for plan in engine.executor.plans:
        resumed = [new for new in plan.new_requests if new.num_computed_tokens]
        if plan.swap_in and resumed:
            most = sum(-(-(WINDOW + BLOCK_SIZE) // BLOCK_SIZE) for _ in resumed)
            if len(plan.swap_in) > most + len(plan.swap_out):  # prefix pages brought back may ride along
                return False
    return True


def test_freeing_lets_more_requests_run_at_once():
    kept = windowed_engine(14, free_pages=False)
    freed = windowed_engine(14)
    assert run(freed) == run(kept)
    assert freed.scheduler.num_preemptions < kept.scheduler.num_preemptions


@pytest.mark.parametrize("window, async_scheduling", [(WINDOW, False), (WINDOW, True), (1, True)])
def test_no_cached_prefix_points_at_a_page_that_holds_something_else(window, async_scheduling):
    """Pages given back keep their content key until allocation evicts them: after every step, each key
    the prefix index holds names a page whose slots hold exactly that block's positions and tokens.
    Window 1 with async scheduling gives a page back while its last token is still a placeholder, so
    before its key is known: it must never be registered afterwards (its table slot is a stand-in)."""
    engine = windowed_engine(12, window=window, async_scheduling=async_scheduling)
    requests = [make_request(prompt, max_tokens=20, request_id=f"q{i}") for i, prompt in enumerate(PROMPTS)]
    for request in requests:
        engine.add_request(request)
    pool, slots = engine.scheduler.kv.pool, engine.executor.slots
    checked = 0
    while engine.has_unfinished():
        engine.step()
        blocks = {key: (index, request.all_token_ids[index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE])
                  for request in requests for index, key in enumerate(request.block_hashes)}
        for key in pool.cached_keys():
            index, tokens = blocks[key]
            block_id = pool.lookup(key)
            held = [slots.get(block_id * BLOCK_SIZE + offset) for offset in range(BLOCK_SIZE)]
            assert held == [(index * BLOCK_SIZE + offset, token) for offset, token in enumerate(tokens)]
            checked += 1
    assert checked > 100
    assert engine.scheduler.num_preemptions > 0 or window == 1  # window 1: everything fits at once


def test_static_policy_and_full_attention_models_keep_every_page():
    # static reserves up front; sliding_window None is what a model with a full-attention layer reports
    for config in ({"kv_policy": "static"}, {"free_pages": False}):
        engine = windowed_engine(64, **config)
        request = make_request([3, 1, 4], max_tokens=40)
        engine.add_request(request)
        while request.num_output_tokens < 39:
            engine.step()
        assert engine.scheduler.kv.pool.num_used == -(-(3 + 40) // BLOCK_SIZE)
