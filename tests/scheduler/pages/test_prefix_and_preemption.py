from scheduler.request import RequestStatus
from tests.scheduler.conftest import make_engine, make_request


def _outputs(engine, requests):
    engine.run_to_completion(requests)
    return {r.request_id: r.output_token_ids for r in requests}


def test_prefix_hit_computes_only_the_rest():
    engine = make_engine(block_size=4)
    shared = list(range(10, 22))  # 12 tokens = 3 full pages
    first = make_request(shared + [1, 2, 3], max_tokens=2)
    engine.run_to_completion([first])
    second = make_request(shared + [7, 8], max_tokens=2)
    engine.add_request(second)
    engine.step()
    plan = engine.executor.plans[-1]
    assert second.num_cached_tokens == 12
    assert plan.new_requests[0].num_computed_tokens == 12
    assert plan.num_scheduled_tokens[second.request_id] == 2  # 14 prompt tokens - 12 cached
    engine.run_to_completion([])
    # same output as computing it all from scratch
    cold = make_engine(block_size=4, enable_prefix_caching=False)
    twin = make_request(shared + [7, 8], max_tokens=2)
    cold.run_to_completion([twin])
    assert second.output_token_ids == twin.output_token_ids
    stats = engine.scheduler.stats()
    assert stats.prefix_cache_hits == 12 and stats.prefix_cache_queries == 15 + 14


def test_full_prompt_hit_still_computes_the_last_token():
    engine = make_engine(block_size=4)
    prompt = list(range(30, 38))  # exactly 2 pages
    engine.run_to_completion([make_request(prompt, max_tokens=1)])
    again = make_request(prompt, max_tokens=1)
    engine.add_request(again)
    engine.step()
    assert again.num_cached_tokens == 4
    assert engine.executor.plans[-1].num_scheduled_tokens[again.request_id] == 4


def test_preemption_by_recompute_keeps_greedy_output():
    prompts = [[i + 1] * (5 + 3 * i) for i in range(8)]

    def run(num_blocks):
        engine = make_engine(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32)
        requests = [make_request(p, max_tokens=24, request_id=f"q{i}") for i, p in enumerate(prompts)]
        return engine, _outputs(engine, requests), requests

    _, expected, _ = run(num_blocks=256)
    engine, got, requests = run(num_blocks=14)  # 8 requests need up to 12 pages each
    assert got == expected
    assert engine.scheduler.num_preemptions > 0
    assert sum(r.num_preemptions for r in requests) == engine.scheduler.num_preemptions
    assert engine.scheduler.kv.pool.num_free == 14


def test_priority_preempts_the_lowest_priority():
    engine = make_engine(num_blocks=6, block_size=4, queue_policy="priority")
    low = make_request([1] * 8, max_tokens=12, priority=9, request_id="low")
    high = make_request([2] * 8, max_tokens=12, priority=0, request_id="high")
    engine.add_request(low)
    engine.add_request(high)
    engine.run_to_completion([])
    assert low.num_preemptions > 0 and high.num_preemptions == 0
    assert low.num_output_tokens == high.num_output_tokens == 12


def test_abort_frees_pages_and_tells_the_worker():
    engine = make_engine(num_blocks=32, block_size=4)
    running = make_request(range(1, 14), max_tokens=100)
    waiting = make_request(range(1, 5), max_tokens=100)
    engine.add_request(running)
    engine.step()
    engine.add_request(waiting)
    assert engine.scheduler.kv.pool.num_used > 0
    engine.abort_request(running.request_id)
    engine.abort_request(waiting.request_id)
    assert running.status == RequestStatus.FINISHED_ABORTED
    assert engine.scheduler.kv.pool.num_used == 0
    other = make_request([9, 9], max_tokens=1)
    engine.run_to_completion([other])
    assert running.request_id in engine.executor.plans[-1].finished_request_ids
    assert running.request_id not in engine.executor.tokens


def test_static_policy_reserves_the_maximum_up_front():
    paged = make_engine(num_blocks=64, block_size=4)
    static = make_engine(num_blocks=64, block_size=4, kv_policy="static")
    for engine in (paged, static):
        engine.add_request(make_request(range(1, 9), max_tokens=40))
        engine.step()
    assert paged.scheduler.kv.pool.num_used == 2  # just the 8 prompt tokens so far
    assert static.scheduler.kv.pool.num_used == 12  # (8 + 40) / 4 up front
    assert static.scheduler.stats().kv_utilization < paged.scheduler.stats().kv_utilization
    paged.run_to_completion([])
    static.run_to_completion([])
    assert paged.scheduler.kv.pool.num_used == static.scheduler.kv.pool.num_used == 0


def test_static_policy_admits_fewer_requests_at_once():
    def peak_running(policy):
        engine = make_engine(num_blocks=40, block_size=4, kv_policy=policy)
        for i in range(10):
            engine.add_request(make_request([i + 1] * 8, max_tokens=32))
        peak = 0
        while engine.has_unfinished():
            engine.step()
            peak = max(peak, len(engine.scheduler.running))
        return peak, engine.scheduler.num_preemptions

    static_peak, static_preemptions = peak_running("static")
    paged_peak, _ = peak_running("paged")
    assert static_peak == 4 and static_preemptions == 0  # 40 pages / 10 pages each
    assert paged_peak > static_peak
