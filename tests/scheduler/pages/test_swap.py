"""Preemption by swap: a victim's computed pages move to the host tier and back, chosen over recompute
by cost, with the same output as an undisturbed run (the fake executor reads every token back through
the pages, so a wrong copy changes the output)."""
from __future__ import annotations

from core.step import StepResult
from scheduler.pages.preemption import RecomputeRate, swap_is_cheaper
from tests.scheduler.conftest import make_engine, make_request

PROMPTS = [[i + 1] * (5 + 3 * i) for i in range(8)]


def run(num_blocks, async_scheduling=False, **config):
    engine = make_engine(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32,
                         async_scheduling=async_scheduling, **config)
    requests = [make_request(p, max_tokens=24, request_id=f"q{i}") for i, p in enumerate(PROMPTS)]
    engine.run_to_completion(requests)
    return engine, {r.request_id: r.output_token_ids for r in requests}


def computed_tokens(engine) -> int:
    return sum(plan.total_num_scheduled_tokens for plan in engine.executor.plans)


def test_swapped_requests_resume_where_they_were_with_the_same_output():
    _, expected = run(num_blocks=256)
    for async_scheduling in (False, True):
        swapped, got = run(num_blocks=14, async_scheduling=async_scheduling, num_host_blocks=64)
        assert got == expected
        scheduler = swapped.scheduler
        assert scheduler.num_swapped_preemptions == scheduler.num_preemptions > 0
        plans = swapped.executor.plans
        copied_out = [copy for plan in plans for copy in plan.swap_out]
        copied_in = [copy for plan in plans for copy in plan.swap_in]
        assert len(copied_out) >= len(copied_in) > 0  # out: victims' pages and evicted prefix pages
        # resumed requests arrive in full with their computed tokens, nothing recomputed
        resumed = [new for plan in plans if plan.swap_in for new in plan.new_requests if new.num_computed_tokens]
        assert resumed
        recomputed, _ = run(num_blocks=14, async_scheduling=async_scheduling)
        assert computed_tokens(swapped) < computed_tokens(recomputed)
        assert scheduler.kv.pool.num_free == 14 and scheduler.kv.host_pool.num_free == 64


def test_a_full_host_tier_falls_back_to_recompute():
    _, expected = run(num_blocks=256)
    engine, got = run(num_blocks=14, num_host_blocks=2)  # a victim holds more than 2 pages
    assert got == expected
    assert engine.scheduler.num_preemptions > engine.scheduler.num_swapped_preemptions


def test_swap_or_recompute_by_cost():
    rate = RecomputeRate()
    assert swap_is_cheaper(64, 4, 10**6, 4e9, rate)  # nothing measured yet: swap
    rate.observe(1000, 10**9)  # 1000 tokens/s
    # 4 pages of 1 MB out and back at 4 GB/s = 2 ms < 64 tokens at 1000 tokens/s = 64 ms
    assert swap_is_cheaper(64, 4, 10**6, 4e9, rate)
    # 4 pages of 1 GB = 2 s > 64 ms
    assert not swap_is_cheaper(64, 4, 10**9, 4e9, rate)


def test_scheduler_recomputes_when_copies_cost_more_than_the_measured_compute():
    engine = make_engine(num_blocks=14, block_size=4, max_num_batched_tokens=32, num_host_blocks=64,
                         bytes_per_block=10**9)  # 1 GB pages: 2 s per page out and back at 4 GB/s
    engine.scheduler.recompute_rate.observe(1000, 10**6)  # a step that ran a million tokens/s
    requests = [make_request(p, max_tokens=24) for p in PROMPTS]
    engine.run_to_completion(requests)
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_swapped_preemptions == 0


def test_steps_teach_the_recompute_rate():
    engine = make_engine(num_blocks=64, block_size=4)
    engine.add_request(make_request([1, 2, 3, 4], max_tokens=2))
    plan = engine.scheduler.schedule()
    engine.scheduler.update(plan, StepResult(plan.step_id, {}, forward_ns=2_000_000))  # 4 tokens in 2 ms
    assert engine.scheduler.recompute_rate.tokens_per_s == 2000


def test_worker_loss_forgets_the_host_tier():
    engine = make_engine(num_blocks=14, block_size=4, max_num_batched_tokens=32, num_host_blocks=64)
    requests = [make_request(p, max_tokens=24) for p in PROMPTS]
    for request in requests:
        engine.add_request(request)
    while not engine.scheduler.kv.host_tables:
        engine.step()
    engine.scheduler.requeue_after_worker_loss()
    assert not engine.scheduler.kv.host_tables and engine.scheduler.kv.host_pool.num_free == 64
    assert all(request.num_computed_tokens == 0 for request in engine.scheduler.waiting)


def test_evicted_prefix_pages_come_back_from_the_host_tier():
    shared = list(range(10, 26))  # 16 tokens = 4 full pages
    engine = make_engine(num_blocks=12, block_size=4, max_num_batched_tokens=32, num_host_blocks=16)
    engine.run_to_completion([make_request(shared + [1, 2], max_tokens=2)])
    # other prompts take every device page, evicting the shared prefix from the device index
    engine.run_to_completion([make_request([90 + i] * 40, max_tokens=2) for i in range(2)])
    assert all(engine.scheduler.kv.pool.lookup(key) is None for key in engine.scheduler.kv.host_pool.cached_keys())
    kept = [copy for plan in engine.executor.plans for copy in plan.swap_out]
    assert len(kept) >= 4

    again = make_request(shared + [7, 8], max_tokens=3)
    engine.add_request(again)
    engine.step()
    plan = engine.executor.plans[-1]
    assert again.num_cached_tokens == 16 and plan.num_scheduled_tokens[again.request_id] == 2
    assert len(plan.swap_in) == 4 and engine.scheduler.kv.host_prefix_hits == 16
    engine.run_to_completion([])
    cold = make_engine(block_size=4, enable_prefix_caching=False)
    twin = make_request(shared + [7, 8], max_tokens=3)
    cold.run_to_completion([twin])
    assert again.output_token_ids == twin.output_token_ids  # the pages came back with the right K/V


def test_stats_count_swapped_requests_and_host_pages_while_they_are_out():
    """What vllm:num_requests_swapped and vllm:cpu_cache_usage_perc read (scheduler.stats)."""
    engine = make_engine(num_blocks=14, block_size=4, max_num_batched_tokens=32, num_host_blocks=64)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(make_request(prompt, max_tokens=24, request_id=f"q{i}"))
    seen_swapped = 0
    while engine.has_unfinished():
        engine.step()
        stats = engine.scheduler.stats()
        assert stats.num_swapped == len(engine.scheduler.kv.host_tables)
        assert stats.num_host_blocks == 64 and 0 <= stats.num_used_host_blocks <= 64
        if stats.num_swapped:
            seen_swapped += 1
            assert stats.num_used_host_blocks > 0  # a swapped request's pages are in the host tier
    assert seen_swapped and engine.scheduler.stats().num_swapped == 0
