"""Latency targets per API key (a class of service): a request may carry its key's target_itl_ms /
target_ttft_ms. A step's ITL target is the tightest among its running requests' (each one's own, else
the scheduler's flag), so a tight-target request's presence shrinks the step budget and its absence
restores it; waiting requests with TTFT targets get their prefill first, nearest deadline first. Without
per-request targets nothing changes (tests/scheduler/test_latency_targets.py, unchanged, shows that)."""
from __future__ import annotations

import pytest

from core.errors import InvalidArgument
from scheduler.step_time import ITL_FROM_FLAG, ITL_FROM_REQUEST, MIN_OBSERVATIONS
from scheduler.process.telemetry import step_tuning_attributes
from tests.scheduler.conftest import make_request
from tests.scheduler.test_latency_targets import timed_engine

CEILING = 256  # timed_engine's max_num_batched_tokens


def start_decoders(engine, count=8):
    """count untargeted requests decoding, and the step-time model fitted on them."""
    for i in range(count):
        engine.add_request(make_request([i + 1] * 8, max_tokens=200))
    for _ in range(MIN_OBSERVATIONS + 4):
        engine.step()
    assert engine.scheduler.latency.step_time.ready and len(engine.scheduler.running) == count


def step_tuning(engine):
    """Steps once; (the plan, its tuning record)."""
    engine.step()
    plan = engine.executor.plans[-1]
    return plan, engine.scheduler.pop_step_tuning(plan.step_id)


def test_a_tight_itl_request_shrinks_the_budget_while_it_runs_and_its_absence_restores_it():
    engine = timed_engine()  # no --target-itl-ms: untargeted requests get the full budget
    start_decoders(engine)
    plan, tuning = step_tuning(engine)
    assert engine.scheduler.latency.token_budget == CEILING and tuning.itl_target is None

    tight = make_request([77] * 8, max_tokens=6, target_itl_ms=6.0)
    engine.add_request(tight)
    budgets, sources = [], []
    while tight.request_id in engine.scheduler.requests:
        plan, tuning = step_tuning(engine)
        if tight.request_id in plan.num_scheduled_tokens and tight.num_computed_tokens > 8:  # it decodes
            budgets.append(engine.scheduler.latency.token_budget)
            sources.append((tuning.itl_target.ms, tuning.itl_target.source))
    # 9 requests decoding under 6 ms * 0.8: (4.8 - 2 - 0.45 - context) ms / 0.1 ms per token ~ 20 tokens
    assert budgets and all(9 <= budget < 30 for budget in budgets)
    assert set(sources) == {(6.0, ITL_FROM_REQUEST)}
    attributes = step_tuning_attributes(tuning)
    assert attributes["tokenmill.step.itl_target_ms"] == 6.0
    assert attributes["tokenmill.step.itl_target_source"] == "api_key"

    plan, tuning = step_tuning(engine)  # it finished: the untargeted rest get the full budget again
    assert engine.scheduler.latency.token_budget == CEILING and tuning.itl_target is None
    assert "tokenmill.step.itl_target_ms" not in step_tuning_attributes(tuning)


def test_a_long_prompt_is_chunked_only_while_a_tight_request_decodes():
    engine = timed_engine()
    start_decoders(engine, count=2)
    tight = make_request([77] * 8, max_tokens=40, target_itl_ms=8.0)
    engine.add_request(tight)
    engine.step()
    engine.step()
    long_prompt = make_request([5] * 200, max_tokens=2)
    engine.add_request(long_prompt)
    plan, _ = step_tuning(engine)
    chunk = plan.num_scheduled_tokens[long_prompt.request_id]
    assert chunk < 200 and plan.total_num_scheduled_tokens * 1e-4 + 2e-3 < 8e-3  # under the tight target
    assert plan.num_scheduled_tokens[tight.request_id] == 1  # it kept decoding

    control = timed_engine()  # the same load without the tight request: the prompt goes in whole
    start_decoders(control, count=2)
    control.add_request(make_request([77] * 8, max_tokens=40))
    control.step()
    control.step()
    control_prompt = make_request([5] * 200, max_tokens=2)
    control.add_request(control_prompt)
    plan, _ = step_tuning(control)
    assert plan.num_scheduled_tokens[control_prompt.request_id] == 200


def test_the_tightest_target_governs_and_a_looser_key_does_not_tighten_the_flag():
    engine = timed_engine(target_itl_ms=10.0)
    start_decoders(engine, count=4)
    _, tuning = step_tuning(engine)
    assert (tuning.itl_target.ms, tuning.itl_target.source) == (10.0, ITL_FROM_FLAG)
    flag_budget = engine.scheduler.latency.token_budget

    loose = make_request([70] * 8, max_tokens=30, target_itl_ms=50.0)
    engine.add_request(loose)
    engine.step()
    _, tuning = step_tuning(engine)  # the untargeted ones still have the flag's 10 ms
    assert (tuning.itl_target.ms, tuning.itl_target.source) == (10.0, ITL_FROM_FLAG)

    tight = make_request([71] * 8, max_tokens=30, target_itl_ms=5.0)
    engine.add_request(tight)
    engine.step()
    _, tuning = step_tuning(engine)
    assert (tuning.itl_target.ms, tuning.itl_target.source) == (5.0, ITL_FROM_REQUEST)
    assert engine.scheduler.latency.token_budget < flag_budget


def test_requests_that_all_bring_their_own_class_are_not_held_to_the_flag():
    engine = timed_engine(target_itl_ms=5.0)
    for i in range(4):
        engine.add_request(make_request([i + 1] * 8, max_tokens=100, target_itl_ms=40.0))
    for _ in range(MIN_OBSERVATIONS + 4):
        engine.step()
    _, tuning = step_tuning(engine)
    assert (tuning.itl_target.ms, tuning.itl_target.source) == (40.0, ITL_FROM_REQUEST)
    assert engine.scheduler.latency.token_budget == CEILING  # 40 ms allows more than 256 tokens


def test_a_tight_ttft_request_gets_its_prefill_before_earlier_looser_ones():
    engine = timed_engine()  # budget 256: two 200-token prompts cannot both go in whole
    first = make_request([1] * 200, max_tokens=2, arrival_time=0.0)
    second = make_request([2] * 200, max_tokens=2, arrival_time=0.01, target_ttft_ms=100.0)
    engine.add_request(first)
    engine.add_request(second)
    plan, _ = step_tuning(engine)
    assert [new.request_id for new in plan.new_requests] == [second.request_id, first.request_id]
    assert plan.num_scheduled_tokens == {second.request_id: 200, first.request_id: 56}

    control = timed_engine()  # without the target: arrival order, as today
    first, second = make_request([1] * 200, max_tokens=2), make_request([2] * 200, max_tokens=2)
    control.add_request(first)
    control.add_request(second)
    plan, _ = step_tuning(control)
    assert plan.num_scheduled_tokens == {first.request_id: 200, second.request_id: 56}


def test_the_nearest_ttft_deadline_goes_first():
    engine = timed_engine()
    relaxed = make_request([1] * 200, max_tokens=2, arrival_time=0.0, target_ttft_ms=2000.0)  # due at 2.0 s
    urgent = make_request([2] * 200, max_tokens=2, arrival_time=0.5, target_ttft_ms=300.0)  # due at 0.8 s
    untargeted = make_request([3] * 200, max_tokens=2, arrival_time=0.0)
    for request in (untargeted, relaxed, urgent):
        engine.add_request(request)
    plan, _ = step_tuning(engine)
    assert [new.request_id for new in plan.new_requests] == [urgent.request_id, relaxed.request_id]
    assert plan.num_scheduled_tokens[urgent.request_id] == 200
    engine.step()
    assert untargeted.request_id in engine.executor.plans[-1].num_scheduled_tokens  # then the rest


def test_a_request_about_to_miss_its_own_ttft_target_gets_the_full_budget():
    now = [0.0]
    engine = timed_engine(target_itl_ms=5.0)  # no --target-ttft-ms: only the key's target can trigger it
    engine.scheduler.clock = lambda: now[0]
    for i in range(4):
        engine.add_request(make_request([i + 1] * 8, max_tokens=80, arrival_time=0.0))
    for _ in range(MIN_OBSERVATIONS + 4):
        engine.step()
    assert engine.scheduler.latency.token_budget < CEILING
    engine.add_request(make_request([8] * 200, max_tokens=2, arrival_time=0.0))  # no target: budget stays cut
    now[0] = 0.09
    engine.step()
    assert engine.scheduler.latency.token_budget < CEILING
    engine.add_request(make_request([9] * 200, max_tokens=2, arrival_time=0.0, target_ttft_ms=100.0))
    engine.step()  # it has waited 90 ms of its 100
    assert engine.scheduler.latency.token_budget == CEILING


@pytest.mark.parametrize("field", ["target_itl_ms", "target_ttft_ms"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_a_bad_target_is_refused_naming_the_field(field, value):
    engine = timed_engine()
    with pytest.raises(InvalidArgument, match=f"{field}="):
        engine.add_request(make_request([1] * 8, **{field: value}))
