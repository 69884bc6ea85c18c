"""The step-time model on its own: a least-squares fit over recent steps, weights never negative, and a
feature the steps did not vary held at what it was rather than fitted to noise."""
from __future__ import annotations

import random

from scheduler.step_time import WINDOW, StepShape, StepTimeModel


def cpu_cost_s(shape: StepShape) -> float:
    """A machine like a 2-core CPU serving a small model: 60 ms a step, 2.3 ms a token, 4 ms a request."""
    return 0.06 + 0.0023 * shape.num_tokens + 0.004 * shape.num_requests + 0.01 * shape.num_context_tokens / 1000


def single_request_steps(rng: random.Random, num_requests: int = 12):
    """Sync mode on a shared machine: each request a 64-token prefill and 16-32 decodes, one at a time,
    each step's time its cost times U(0.7, 1.6)."""
    for _ in range(num_requests):
        context = 64
        yield StepShape(64, 1, context)
        for _ in range(rng.randint(16, 32)):
            context += 1
            yield StepShape(1, 1, context)


def test_steps_of_one_request_teach_nothing_about_the_cost_of_more_requests():
    rng = random.Random(1)
    model = StepTimeModel()
    for shape in single_request_steps(rng):
        model.observe(shape, cpu_cost_s(shape) * rng.uniform(0.7, 1.6))
    assert min(model.weights) >= 0
    # the per-request and context weights were never pinned down: held at 0, not fitted to the noise
    # (which put -0.38 s per 1000 context tokens and 51 ms per request into a recursive fit, so a step of
    # 32 decodes was predicted at 791 ms, 2.8 times its cost, and the scheduler stopped admitting)
    assert model.weights[2] == model.weights[3] == 0.0
    for shape in (StepShape(32, 32, 2500), StepShape(8, 8, 600), StepShape(72, 9, 700)):
        assert model.predict_s(shape) < 1.2 * cpu_cost_s(shape)
    # what the steps did vary is learnt: a token costs about 2.3 ms
    assert 0.0015 < model.weights[1] < 0.0035


def test_once_the_steps_vary_it_the_fit_learns_it_and_keeps_it():
    model = StepTimeModel()
    shapes = [StepShape(tokens, requests, context) for tokens, requests, context in
              [(1, 1, 100), (64, 2, 900), (8, 8, 4000), (256, 1, 256), (16, 16, 16000), (3, 3, 300)]]
    for _ in range(10):
        for shape in shapes:
            model.observe(shape, cpu_cost_s(shape))
    learnt = list(model.weights)
    assert abs(learnt[2] - 0.004) < 1e-6 and abs(learnt[3] - 0.01) < 1e-6
    for context in range(100, 100 + WINDOW + 10):  # then a long run of single decodes: nothing about requests
        model.observe(StepShape(1, 1, context), cpu_cost_s(StepShape(1, 1, context)))
    assert abs(model.weights[2] - 0.004) < 1e-6  # still known
    probe = StepShape(8, 8, 800)
    assert abs(model.predict_s(probe) - cpu_cost_s(probe)) < 1e-6


def test_the_fit_follows_the_machine_within_a_window():
    model = StepTimeModel()
    rng = random.Random(2)
    shapes = [StepShape(rng.randint(1, 300), rng.randint(1, 32), rng.randint(100, 9000)) for _ in range(2 * WINDOW)]
    for shape in shapes[:WINDOW]:
        model.observe(shape, cpu_cost_s(shape))
    for shape in shapes[WINDOW:]:  # the machine became twice as slow (another process on its cores)
        model.observe(shape, 2 * cpu_cost_s(shape))
    probe = StepShape(100, 10, 3000)
    assert abs(model.predict_s(probe) - 2 * cpu_cost_s(probe)) < 0.01 * cpu_cost_s(probe)
