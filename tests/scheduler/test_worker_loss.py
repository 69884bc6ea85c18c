"""A worker replaced mid-generation (its KV cache gone): requeue_after_worker_loss puts the running
requests back for recompute and empties the prefix cache, and the outputs equal an undisturbed run.
The fake executor reads tokens back through the block tables, so a prefix hit on a page the new
worker never wrote fails its "stale page" check."""
from __future__ import annotations

from scheduler.request import RequestStatus
from tests.helpers.fake_executor import FakeExecutor
from tests.scheduler.conftest import make_engine, make_request

PREFIX = list(range(1, 13))  # three full pages of 4: shared through the prefix cache


def requests():
    return [make_request(PREFIX + [20 + i], max_tokens=10, request_id=f"loss-{i}") for i in range(3)]


def outputs_of(results):
    return {rid: [t for out in outs for t in out.new_token_ids] for rid, outs in results.items()}


def test_requeued_requests_recompute_to_the_undisturbed_output_and_no_prefix_hits_a_wiped_page():
    expected = outputs_of(make_engine().run_to_completion(requests()))

    engine = make_engine()
    got: dict[str, list[int]] = {}
    for request in requests():
        engine.add_request(request)
    for _ in range(5):  # prefill and a few decode steps
        for output in engine.step():
            got.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert engine.scheduler.running

    engine.executor = FakeExecutor(engine.executor.num_blocks, engine.executor.block_size)  # the new worker
    requeued = engine.scheduler.requeue_after_worker_loss()
    assert sorted(requeued) == ["loss-0", "loss-1", "loss-2"]
    assert engine.scheduler.kv.pool.num_used == 0 and not engine.scheduler.running
    assert all(r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0 for r in engine.scheduler.waiting)
    assert [r.request_id for r in engine.scheduler.waiting] == requeued  # running order kept, at the head

    late = make_request(PREFIX + [99], max_tokens=4, request_id="after-loss")  # would hit the old pages
    engine.add_request(late)
    while engine.has_unfinished():
        for output in engine.step():
            got.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert {rid: got[rid] for rid in expected} == expected
    assert len(got["after-loss"]) == 4
