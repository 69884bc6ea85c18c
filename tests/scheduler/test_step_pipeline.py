"""The step pipeline's one rule, fed by hand: how many steps are in flight, when a result is applied,
and what a lost worker leaves behind."""
from __future__ import annotations

import pytest

from core.step import PLACEHOLDER_TOKEN_ID
from scheduler.config import SchedulerConfig
from scheduler.scheduler import Scheduler
from scheduler.step_pipeline import ASYNC_SCHEDULING, SYNC, StepPipeline
from tests.helpers.fake_executor import FakeExecutor
from tests.scheduler.conftest import make_request


def pipeline_with(depth: int, *prompts: list[int]) -> tuple[StepPipeline, FakeExecutor]:
    scheduler = Scheduler(SchedulerConfig(num_blocks=64, block_size=4))
    for i, prompt in enumerate(prompts):
        scheduler.add_request(make_request(prompt, max_tokens=3, request_id=f"p{i}"))
    return StepPipeline(scheduler, depth), FakeExecutor(64, 4)


def test_depth_one_applies_each_step_before_planning_the_next():
    pipeline, executor = pipeline_with(SYNC, [1, 2, 3])
    sent = pipeline.send_next(executor.execute)
    assert sent is not None and pipeline.num_in_flight == 1
    assert pipeline.send_next(executor.execute) is None  # full: no second plan before the result
    step = pipeline.oldest_to_collect(sent)
    assert step is not None and step.plan is sent
    outputs = pipeline.apply(step.pending)
    assert [o.new_token_ids for o in outputs] == [[executor.tokens["p0"][3]]] and not pipeline.num_in_flight


def test_depth_two_sends_the_next_plan_before_the_first_result_is_applied():
    pipeline, executor = pipeline_with(ASYNC_SCHEDULING, [1, 2, 3])
    first = pipeline.send_next(executor.execute)
    assert pipeline.oldest_to_collect(first) is None  # room for one more: plan it before waiting
    request = pipeline.scheduler.requests["p0"]
    assert request.all_token_ids[-1] == PLACEHOLDER_TOKEN_ID  # planned as if step 0 were done
    second = pipeline.send_next(executor.execute)
    assert second is not None and second.num_scheduled_tokens == {"p0": 1} and pipeline.num_in_flight == 2
    assert pipeline.send_next(executor.execute) is None
    assert pipeline.oldest_to_collect(second).plan is first  # results are applied in step order
    outputs = pipeline.apply(pipeline.oldest_to_collect(second).pending)
    assert [o.new_token_ids for o in outputs] == [[executor.tokens["p0"][3]]] and outputs[0].num_output_tokens == 1


def test_nothing_to_plan_collects_what_is_in_flight_and_an_idle_pipeline_has_no_work():
    pipeline, executor = pipeline_with(ASYNC_SCHEDULING, [1, 2, 3])
    outputs = []
    while pipeline.has_work():
        sent = pipeline.send_next(executor.execute)
        step = pipeline.oldest_to_collect(sent)
        if step is not None:
            outputs += pipeline.apply(step.pending)
    assert [t for o in outputs for t in o.new_token_ids] == executor.tokens["p0"][3:6]
    assert outputs[-1].finished and pipeline.scheduler.kv.pool.num_used == 0


def test_abandon_hands_back_every_step_in_flight():
    pipeline, _ = pipeline_with(ASYNC_SCHEDULING, [1, 2, 3], [4, 5])
    pipeline.send_next(lambda plan: f"sent {plan.step_id}")
    pipeline.send_next(lambda plan: f"sent {plan.step_id}")
    assert pipeline.abandon() == ["sent 0", "sent 1"] and not pipeline.num_in_flight
    assert pipeline.has_work()  # the requests themselves are the scheduler's to requeue or end


def test_only_the_two_depths_exist():
    with pytest.raises(ValueError, match="depth=3"):
        StepPipeline(Scheduler(SchedulerConfig(num_blocks=8, block_size=4)), 3)
