"""Latency targets: the step-time model learns how long steps take, and the scheduler picks each step's
token budget and running-set size to keep steps under --target-itl-ms (prefill chunks shrink, decodes
keep running), gives a request about to miss --target-ttft-ms the full budget, and changes nothing
without targets. The fake executor's step times come from a known cost function (the model outputs
are the only fake here)."""
from __future__ import annotations

from scheduler.step_time import MIN_OBSERVATIONS, StepShape, StepTimeModel
from tests.helpers.fake_executor import FakeExecutor
from tests.scheduler.conftest import make_engine, make_request


def cost_s(shape: StepShape) -> float:
    """A made-up machine: 2 ms per step, 0.1 ms per token, 0.05 ms per request, 0.3 ms per 1000 context tokens."""
    return 2e-3 + 1e-4 * shape.num_tokens + 5e-5 * shape.num_requests + 3e-4 * shape.num_context_tokens / 1000


class TimedFakeExecutor(FakeExecutor):
    """FakeExecutor whose steps report cost_s of what they computed as their forward time."""

    def execute(self, plan):
        context = sum(self.computed.get(request_id, 0) + num_tokens
                      for request_id, num_tokens in plan.num_scheduled_tokens.items()
                      if request_id not in {new.request_id for new in plan.new_requests})
        context += sum(new.num_computed_tokens + plan.num_scheduled_tokens[new.request_id] for new in plan.new_requests)
        result = super().execute(plan)
        shape = StepShape(plan.total_num_scheduled_tokens, len(plan.num_scheduled_tokens), context)
        result.forward_ns = int(cost_s(shape) * 1e9)
        return result


def timed_engine(**config):
    engine = make_engine(num_blocks=512, block_size=4, max_num_batched_tokens=256, **config)
    engine.executor = TimedFakeExecutor(512, 4)
    engine.scheduler.clock = lambda: 0.0  # steps take their fake forward time, whatever this machine's load
    return engine


def test_the_model_learns_a_linear_step_time():
    model = StepTimeModel()
    shapes = [StepShape(tokens, requests, context) for tokens, requests, context in
              [(1, 1, 100), (64, 2, 900), (8, 8, 4000), (256, 1, 256), (16, 16, 16000), (3, 3, 300),
               (128, 4, 2000), (32, 32, 9000), (200, 5, 7000), (5, 5, 500)]]
    for _ in range(3):
        for shape in shapes:
            model.observe(shape, cost_s(shape))
    assert model.ready
    probe = StepShape(100, 10, 5000)
    assert abs(model.predict_s(probe) - cost_s(probe)) < 0.01 * cost_s(probe)
    # 8 ms allowed for 10 requests over 5000 tokens: (8 - 2 - 0.5 - 1.5) ms / 0.1 ms = 40 tokens
    assert abs(model.max_tokens_within(8e-3, 10, 5000) - 40) <= 1
    assert StepTimeModel().max_tokens_within(8e-3, 1, 1) is None  # nothing learnt yet


def run_mixed_load(engine):
    """8 long-running decoders, then long prompts arriving while they decode."""
    decoders = [make_request([i + 1] * 8, max_tokens=60) for i in range(8)]
    for request in decoders:
        engine.add_request(request)
    for _ in range(12):
        engine.step()
    for i in range(4):
        engine.add_request(make_request([i + 50] * 200, max_tokens=4))
    step_times = []
    while engine.has_unfinished():
        before = len(engine.executor.plans)
        engine.step()
        plan = engine.executor.plans[-1] if len(engine.executor.plans) > before else None
        if plan is not None:
            step_times.append((plan, engine.scheduler.latency.token_budget))
    return step_times


def test_itl_target_keeps_steps_under_it_by_shrinking_prefill_chunks():
    untargeted = timed_engine()
    untargeted_steps = run_mixed_load(untargeted)
    # without a target a 200-token prompt shares a step with the decodes: > 24 ms
    assert max(plan.total_num_scheduled_tokens for plan, _ in untargeted_steps) > 200

    engine = timed_engine(target_itl_ms=10.0)
    steps = run_mixed_load(engine)
    assert engine.scheduler.latency.step_time.num_observations > MIN_OBSERVATIONS
    # every step once the model is fitted: predicted under 80% of the target, measured under the target
    late = steps[MIN_OBSERVATIONS + 1:]
    assert all(budget < 256 for _, budget in late)
    assert max(plan.total_num_scheduled_tokens for plan, _ in late) * 1e-4 + 2e-3 < 10e-3
    assert engine.scheduler.latency.num_itl_target_misses == 0
    # prefills went in chunks beside decodes, which never stopped
    mixed = [plan for plan, _ in late if any(n > 1 for n in plan.num_scheduled_tokens.values())
             and sum(1 for n in plan.num_scheduled_tokens.values() if n == 1) >= 4]
    assert mixed
    assert engine.scheduler.stats().token_budget == engine.scheduler.latency.token_budget


def test_ttft_target_gives_a_waiting_request_the_full_budget():
    now = [0.0]
    engine = timed_engine(target_itl_ms=5.0, target_ttft_ms=100.0)
    engine.scheduler.clock = lambda: now[0]
    for i in range(4):
        engine.add_request(make_request([i + 1] * 8, max_tokens=80, arrival_time=0.0))
    for _ in range(MIN_OBSERVATIONS + 4):
        engine.step()
    assert engine.scheduler.latency.token_budget < 256
    engine.add_request(make_request([9] * 200, max_tokens=2, arrival_time=0.0))
    now[0] = 0.09  # it has waited 90 ms of its 100
    engine.step()
    assert engine.scheduler.latency.token_budget == 256


def test_without_targets_every_step_has_the_fixed_budget():
    engine = timed_engine()
    steps = run_mixed_load(engine)
    assert all(budget == 256 for _, budget in steps)
    # the first prompt goes in whole beside the decodes, as before targets existed
    assert any(200 in plan.num_scheduled_tokens.values() for plan, _ in steps)
    assert engine.scheduler.latency.num_itl_target_misses == 0 and engine.scheduler.latency.step_time.ready


def test_a_step_that_decodes_nobody_gets_the_whole_budget():
    """No request waits for its next token: a prompt alone is a first token's wait, not an inter-token gap."""
    engine = timed_engine(target_itl_ms=10.0)
    run_mixed_load(engine)  # the model is fitted and every request is done
    assert engine.scheduler.latency.step_time.ready and not engine.has_unfinished()
    prompt = make_request([997] * 300, max_tokens=4)  # no prefix-cache hit: all 300 to compute
    engine.add_request(prompt)
    engine.step()
    assert engine.executor.plans[-1].num_scheduled_tokens == {prompt.request_id: 256}
    engine.step()  # the rest of the prompt: still nobody waiting between tokens
    assert engine.executor.plans[-1].num_scheduled_tokens == {prompt.request_id: 44}
    engine.step()  # it decodes now: the target governs again
    assert engine.scheduler.pop_step_tuning(engine.executor.plans[-1].step_id).itl_target is not None


def test_a_target_changes_nothing_until_the_model_is_fitted():
    engine = timed_engine(target_itl_ms=1.0)  # unreachable: every step misses it
    engine.add_request(make_request([1] * 300, max_tokens=2))
    engine.step()
    assert engine.scheduler.latency.token_budget == 256 and engine.executor.plans[0].total_num_scheduled_tokens == 256


def test_step_time_counts_the_trip_to_the_worker():
    """A step's time runs from planning to its result: RPC and sampling around the forward pass count."""
    import itertools

    engine = timed_engine(target_itl_ms=100.0)
    ticks = itertools.count()
    engine.scheduler.clock = lambda: next(ticks) * 0.05  # each reading 50 ms later: steps take >= 50 ms
    engine.add_request(make_request([1] * 8, max_tokens=40))
    for _ in range(MIN_OBSERVATIONS + 4):
        engine.step()
    assert engine.scheduler.latency.step_time.predict_s(StepShape(1, 1, 20)) > 0.04  # not the 2 ms forward pass
