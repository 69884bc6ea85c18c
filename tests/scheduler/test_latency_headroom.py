"""Latency targets on a machine whose step times spread: a step sometimes runs well past what the
step-time model predicts for its shape (another process on the cores, a cache flush). The target is an
inter-token P99, so the share of the target plans aim at (the headroom) is read from the spread of
recent steps near the target: one over their 99.5th percentile of observed / predicted time. The fake
executor's step times are cost_s of the step times a deterministic factor."""
from __future__ import annotations

from tests.scheduler.conftest import make_request
from scheduler.step_time import StepShape
from tests.scheduler.test_latency_targets import TimedFakeExecutor, cost_s, timed_engine

TARGET_MS = 12.0
SLOW_EVERY = 10  # every 10th step runs 1.5 times its cost: 10 % of steps, far above the 1 % a P99 allows
SLOW_FACTOR = 1.5


class SpreadTimedFakeExecutor(TimedFakeExecutor):
    """Every slow_every-th step (of those that decode only, with decodes_only) runs slow_factor times
    its cost; none when slow_every is None."""

    def __init__(self, slow_every: int | None, slow_factor: float = SLOW_FACTOR, decodes_only: bool = False) -> None:
        super().__init__(512, 4)
        self.slow_every, self.slow_factor, self.decodes_only = slow_every, slow_factor, decodes_only
        self.num_candidates = 0
        self.last_forward_ns = 0

    def execute(self, plan):
        result = super().execute(plan)
        if not self.decodes_only or all(n == 1 for n in plan.num_scheduled_tokens.values()):
            self.num_candidates += 1
            if self.slow_every and self.num_candidates % self.slow_every == 0:
                result.forward_ns = int(result.forward_ns * self.slow_factor)
        self.last_forward_ns = result.forward_ns
        return result


def spread_engine(slow_every: int | None = SLOW_EVERY, **executor_and_config):
    executor = {key: executor_and_config.pop(key) for key in ("slow_factor", "decodes_only") if key in executor_and_config}
    engine = timed_engine(**executor_and_config)
    engine.executor = SpreadTimedFakeExecutor(slow_every, **executor)
    return engine


def run_closed_loop(engine, num_steps: int = 600) -> tuple[list[float], int]:
    """8 decoders at all times, each replaced by a 120-token prompt when it ends (closed loop); returns
    the inter-token gaps (ms) after the first 150 steps, and the prompt tokens computed in those steps."""
    for i in range(8):
        engine.add_request(make_request([i + 1] * 8, max_tokens=30))
    now_ms, last_token_ms, gaps, prompt_tokens, next_prompt = 0.0, {}, [], 0, 100
    for step in range(num_steps):
        outputs = engine.step()
        plan, result_ms = engine.executor.plans[-1], engine.executor.last_forward_ns / 1e6
        now_ms += result_ms
        for output in outputs:
            if output.request_id in last_token_ms and step >= 150:
                gaps.append(now_ms - last_token_ms[output.request_id])
            last_token_ms[output.request_id] = now_ms
            if output.finished:
                engine.add_request(make_request([next_prompt] * 120, max_tokens=30))
                next_prompt += 1
        if step >= 150:
            prompt_tokens += sum(n for n in plan.num_scheduled_tokens.values() if n > 1)
    return gaps, prompt_tokens


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]


def test_the_plan_leaves_room_for_the_spread_of_step_times_so_inter_token_p99_meets_the_target():
    engine = spread_engine(target_itl_ms=TARGET_MS)
    gaps, prompt_tokens = run_closed_loop(engine)
    assert len(gaps) > 1000
    assert p99(gaps) <= TARGET_MS  # planned at 80 % of the target, 10 % of steps would run 1.2 times it
    # the plans came down to about 1 / 1.5 of the target (1 / 1.43 of the model's fit of the mean)
    assert 0.55 < engine.scheduler.latency.headroom < 0.72
    # and still admits work: prompts kept going in, in chunks
    assert prompt_tokens > 50 * 120


def test_once_the_spread_is_over_the_plans_grow_back_within_a_window_of_steps():
    """The machine calms down (the other process ended): the headroom follows within RATIO_WINDOW binding
    steps, not over the thousands a miss tracker needs to undo its misses (one moving 10 % down on a
    miss and 0.05 % up on each step without one stood at 0.82 here, 450 steps after the spread ended)."""
    engine = spread_engine(target_itl_ms=TARGET_MS)
    run_closed_loop(engine, num_steps=600)
    assert engine.scheduler.latency.headroom < 0.72
    engine.executor.slow_every = None
    gaps, _ = run_closed_loop(engine, num_steps=450)
    assert engine.scheduler.latency.headroom > 0.9
    assert p99(gaps) <= TARGET_MS


def test_without_spread_the_plans_grow_towards_the_target():
    engine = spread_engine(slow_every=None, target_itl_ms=TARGET_MS)
    run_closed_loop(engine, num_steps=300)
    assert engine.scheduler.latency.num_itl_target_misses == 0
    assert engine.scheduler.latency.headroom > 0.85
    assert abs(engine.scheduler.latency.step_time.last_error_s) < 1e-4  # the steps it saw are predicted


def test_slow_steps_far_below_the_target_do_not_shrink_the_plan():
    """Steps of decodes alone (3.4 ms, a quarter of the target) that now and then take 3 times as long
    (another process on the cores) but stay under the target change nothing: a margin from the ratio
    of observed to predicted times (tried first) made them cut the plans by half."""
    steady = spread_engine(slow_every=None, target_itl_ms=TARGET_MS)
    _, steady_prompt_tokens = run_closed_loop(steady)
    engine = spread_engine(slow_every=3, slow_factor=3.0, decodes_only=True, target_itl_ms=TARGET_MS)
    gaps, prompt_tokens = run_closed_loop(engine)
    assert engine.executor.num_candidates > 100  # the slow decodes happened
    # what misses there were came from the fit of the mean, which the slow decodes skewed: rare
    assert engine.scheduler.latency.num_itl_target_misses <= 0.01 * 600
    assert engine.scheduler.latency.headroom > 0.8
    assert prompt_tokens >= 0.9 * steady_prompt_tokens
    assert p99(gaps) <= TARGET_MS  # and they still made no gap over the target


def test_stalls_no_plan_could_avoid_leave_the_plans_alone():
    """Every 25th step stalls at 10 times its cost (another process took the cores): a smaller plan would
    not have avoided it, so it neither shrinks the plans (counted, they drove the headroom to its floor
    and halved the prompts let in) nor drags the model's fit up."""
    steady = spread_engine(slow_every=None, target_itl_ms=TARGET_MS)
    _, steady_prompt_tokens = run_closed_loop(steady)
    engine = spread_engine(slow_every=25, slow_factor=10.0, target_itl_ms=TARGET_MS)
    _, prompt_tokens = run_closed_loop(engine)
    assert engine.scheduler.latency.num_itl_target_misses >= 20  # the stalls, each over the target
    assert engine.scheduler.latency.headroom > 0.8
    assert prompt_tokens >= 0.9 * steady_prompt_tokens
    # a stall is learnt as 3 times its prediction, not 10: the fit stays near the machine's (+36 % else)
    shape = StepShape(9, 9, 300)
    assert engine.scheduler.latency.step_time.predict_s(shape) < 1.2 * cost_s(shape)
