"""The one rule: num_computed_tokens catches up with num_tokens under a token budget."""
from core.errors import InvalidArgument
from core.outputs import FinishReason
from scheduler.request import RequestStatus
from tests.scheduler.conftest import make_engine, make_request


def test_chunked_prefill_falls_out_of_the_budget():
    engine = make_engine(max_num_batched_tokens=8)
    request = make_request(range(1, 21), max_tokens=3)
    engine.add_request(request)
    chunks = []
    while engine.has_unfinished():
        plan_count = len(engine.executor.plans)
        engine.step()
        chunks.append(engine.executor.plans[plan_count].num_scheduled_tokens[request.request_id])
    assert chunks == [8, 8, 4, 1, 1]  # 20 prompt tokens in three chunks, then one per decode step
    assert request.num_output_tokens == 3
    assert request.status == RequestStatus.FINISHED_LENGTH


def test_budget_is_shared_between_decode_and_prefill():
    engine = make_engine(max_num_batched_tokens=10)
    first = make_request(range(1, 5), max_tokens=20)
    engine.add_request(first)
    engine.step()  # first: 4-token prefill
    second = make_request(range(100, 130), max_tokens=2)
    engine.add_request(second)
    engine.step()
    plan = engine.executor.plans[-1]
    assert plan.num_scheduled_tokens == {first.request_id: 1, second.request_id: 9}
    assert [c.request_id for c in plan.cached_requests] == [first.request_id]
    assert [n.request_id for n in plan.new_requests] == [second.request_id]


def test_max_num_seqs_caps_running_requests():
    engine = make_engine(max_num_seqs=2)
    requests = [make_request([i + 1] * 3, max_tokens=4) for i in range(5)]
    for request in requests:
        engine.add_request(request)
    engine.step()
    assert len(engine.scheduler.running) == 2
    assert len(engine.scheduler.waiting) == 3
    engine.run_to_completion([])
    assert all(r.num_output_tokens == 4 for r in requests)


def test_stop_conditions():
    engine = make_engine()
    eos_probe = make_request([5, 6, 7], max_tokens=50)
    results = engine.run_to_completion([eos_probe])
    tokens = [t for out in results[eos_probe.request_id] for t in out.new_token_ids]
    assert len(tokens) == 50
    eos = tokens[3]
    stops = make_request([5, 6, 7], max_tokens=50, eos_token_id=eos)
    ignores = make_request([5, 6, 7], max_tokens=50, eos_token_id=eos, params={"ignore_eos": True})
    by_stop_id = make_request([5, 6, 7], max_tokens=50, params={"stop_token_ids": (tokens[1],)})
    results = engine.run_to_completion([stops, ignores, by_stop_id])
    assert stops.output_token_ids == tokens[:4] and stops.finish_reason == FinishReason.STOP
    assert ignores.output_token_ids == tokens and ignores.finish_reason == FinishReason.LENGTH
    assert by_stop_id.output_token_ids == tokens[:2] and by_stop_id.finish_reason == FinishReason.STOP
    assert results[stops.request_id][-1].finished


def test_priority_orders_the_waiting_queue():
    engine = make_engine(max_num_seqs=1, queue_policy="priority")
    low = make_request([1, 2], max_tokens=2, priority=5)
    high = make_request([3, 4], max_tokens=2, priority=-1)
    mid = make_request([5, 6], max_tokens=2, priority=0)
    for request in (low, high, mid):
        engine.add_request(request)
    order = []
    while engine.has_unfinished():
        for output in engine.step():
            if output.finished:
                order.append(output.request_id)
    assert order == [high.request_id, mid.request_id, low.request_id]


def test_fcfs_keeps_arrival_order():
    engine = make_engine(max_num_seqs=1)
    requests = [make_request([i + 1, i + 2], max_tokens=2, priority=-i) for i in range(3)]
    order = []
    for request in requests:
        engine.add_request(request)
    while engine.has_unfinished():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == [r.request_id for r in requests]


def test_request_that_can_never_fit_is_refused_with_numbers():
    engine = make_engine(num_blocks=4, block_size=4)
    try:
        engine.add_request(make_request(range(1, 10), max_tokens=10))
    except InvalidArgument as error:
        assert "19 tokens" in str(error) and "5 pages" in str(error) and "4 pages" in str(error)
    else:
        raise AssertionError("expected a refusal")
