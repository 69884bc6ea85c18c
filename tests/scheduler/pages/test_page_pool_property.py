"""Any sequence of add / step / finish / abort / preempt keeps both tiers' page pools consistent
(device pages and, with a swap tier, the host pages of swapped-out requests), also when a sliding
window lets running requests give back their oldest pages."""
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.step import PLACEHOLDER_TOKEN_ID
from scheduler.request import RequestStatus
from tests.scheduler.conftest import make_engine, make_request

NUM_BLOCKS = 12
BLOCK_SIZE = 4

operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(1, 6), min_size=1, max_size=14),
                  st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("preempt"), st.integers(0, 50)),
    ),
    max_size=40,
)


def check_host_pool(scheduler) -> None:
    host_pool, host_tables = scheduler.kv.host_pool, scheduler.kv.host_tables
    # owners: swapped requests, and the swap_in copies not yet sent (prefix pages brought back)
    owners = Counter(b for table in host_tables.values() for b in table) + Counter(scheduler.kv.host_reads)
    for block_id in range(host_pool.num_blocks):
        assert host_pool.ref_counts[block_id] == owners[block_id], f"host block {block_id}: ref count != owners"
    assert host_pool.num_free + len(owners) == host_pool.num_blocks  # no host page lost
    # host pages belong to waiting requests only, covering exactly their computed tokens
    assert set(host_tables) <= {request.request_id for request in scheduler.waiting}
    assert not set(host_tables) & set(scheduler.kv.block_tables), "a request holds pages in both tiers"
    for request in scheduler.waiting:
        swapped = host_tables.get(request.request_id)
        if swapped is None:
            assert request.num_computed_tokens == 0
        else:  # less the pages outside its window, given back before the swap
            window = scheduler.kv.sliding_window
            num_dead = 0 if window is None else max(0, request.num_computed_tokens - window + 1) // BLOCK_SIZE
            assert len(swapped) == -(-request.num_computed_tokens // BLOCK_SIZE) - num_dead > 0


def check_pool(engine) -> None:
    scheduler = engine.scheduler
    pool = scheduler.kv.pool
    owners = Counter(b for request_id in scheduler.kv.block_tables for b in scheduler.kv.live_block_ids(request_id))
    for block_id in range(NUM_BLOCKS):
        assert pool.ref_counts[block_id] == owners[block_id], f"block {block_id}: ref count != owners"
        assert pool.is_free(block_id) == (owners[block_id] == 0), f"block {block_id}: free and owned"
    assert pool.num_free + len(owners) == NUM_BLOCKS  # no page lost
    # pages are owned only by live requests, and running ones cover their computed tokens
    assert set(scheduler.kv.block_tables) <= set(scheduler.requests)
    for request in scheduler.running:
        assert len(scheduler.kv.block_table(request.request_id)) * BLOCK_SIZE >= request.num_computed_tokens
        if scheduler.kv.sliding_window is not None:  # nothing of its window given back
            first_live = len(scheduler.kv.block_table(request.request_id)) - len(scheduler.kv.live_block_ids(request.request_id))
            assert first_live * BLOCK_SIZE <= max(0, request.num_computed_tokens - scheduler.kv.sliding_window + 1)
    check_host_pool(scheduler)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations, st.sampled_from(["paged", "static"]), st.sampled_from(["fcfs", "priority"]), st.booleans(),
       st.sampled_from([0, 3, 8]), st.sampled_from([None, 1, 5]))
def test_page_pool_stays_consistent(ops, kv_policy, queue_policy, async_scheduling, num_host_blocks, sliding_window):
    """async_scheduling: each step is planned while the previous one's result is still pending.
    num_host_blocks: the swap tier (3: often too small, so preemption falls back to recompute).
    sliding_window: the fake model attends only that far back, and the scheduler frees what lies before."""
    engine = make_engine(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=9,
                         kv_policy=kv_policy, queue_policy=queue_policy, async_scheduling=async_scheduling,
                         num_host_blocks=num_host_blocks, sliding_window=sliding_window)
    added = []
    for op in ops:
        kind = op[0]
        if kind == "add":
            _, prompt, max_tokens, priority = op
            request = make_request(prompt, max_tokens=max_tokens, priority=priority)
            if engine.scheduler.kv.blocks_needed_at_most(request) <= NUM_BLOCKS:
                engine.add_request(request)
                added.append(request)
        elif kind == "step":
            for _ in range(op[1]):
                engine.step()
        elif kind == "abort" and added:
            engine.abort_request(added[op[1] % len(added)].request_id)
        elif kind == "preempt" and engine.scheduler.running:
            engine.scheduler._preempt(engine.scheduler.running[op[1] % len(engine.scheduler.running)])
        check_pool(engine)
    engine.run_to_completion([])  # finish everything
    check_pool(engine)
    assert engine.scheduler.kv.pool.num_free == NUM_BLOCKS  # all pages free when idle
    assert engine.scheduler.kv.host_pool.num_free == num_host_blocks
    for request in added:
        assert request.status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                                  RequestStatus.FINISHED_STOPPED)
        assert request.num_pending_tokens == 0 and PLACEHOLDER_TOKEN_ID not in request.all_token_ids
        if request.status == RequestStatus.FINISHED_LENGTH:
            assert request.num_output_tokens == request.sampling_params.max_tokens
