"""One fixed sequence of StepPlans (chunked prefill, a mixed step, decode-only steps; three requests with
scattered block tables) that two runners are compared over, on CPU (interpreter) or CUDA."""
from __future__ import annotations

from core.step import CachedRequestData, NewRequestData, StepPlan
from core.sampling import SamplingParams
from worker.model_runner import ModelRunner

WITH_LOGPROBS = SamplingParams(temperature=0.0, logprobs=3, max_tokens=64)
PLAIN_GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
BLOCK_SIZE = 4
NUM_BLOCKS = 16


def run_mixed_steps(runner: ModelRunner, params: SamplingParams = WITH_LOGPROBS, decode_steps: int = 3) -> list[dict]:
    """Returns, per step, {request id: (token, chosen logprob or None, top ids or None)}."""
    a, b, c = list(range(3, 16)), [40, 41, 42, 43, 44, 45], [7, 100, 9, 200, 11]
    new = {
        "a": NewRequestData("a", a, len(a), params, [9, 2, 5, 14, 1, 13], 0),
        "b": NewRequestData("b", b, len(b), params, [3, 11, 6], 0),
        "c": NewRequestData("c", c, len(c), params, [8, 12, 4], 0),
    }
    plans = [
        StepPlan(1, [new["a"], new["b"]], num_scheduled_tokens={"a": 10, "b": 6}),  # a: first chunk; b: whole prompt
        StepPlan(2, [new["c"]], [CachedRequestData("a", [], 10), CachedRequestData("b", [], 6)],
                 num_scheduled_tokens={"b": 1, "a": 3, "c": 5}),  # mixed: decode, prefix chunk, fresh prompt
    ]
    outputs = [runner.execute(plan) for plan in plans]
    for step in range(3, 3 + decode_steps):  # decode-only steps: the decode kernel, or a graph on CUDA
        cached = [CachedRequestData(rid, [], runner.requests[rid].num_computed_tokens) for rid in ("a", "b", "c")]
        outputs.append(runner.execute(StepPlan(step, cached_requests=cached, num_scheduled_tokens={"a": 1, "b": 1, "c": 1})))
    steps = []
    for out in outputs:
        step = {}
        for rid, token in out.sampled_token_ids.items():
            logprobs = out.logprobs.get(rid)
            step[rid] = (token, logprobs and logprobs.logprob, logprobs and [t for t, _ in logprobs.top])
        steps.append(step)
    return steps


def assert_same_steps(expected: list[dict], actual: list[dict], logprob_atol: float) -> None:
    assert [sorted(step) for step in actual] == [sorted(step) for step in expected]
    for step_expected, step_actual in zip(expected, actual):
        for rid, (token, logprob, top) in step_expected.items():
            assert step_actual[rid][0] == token, (rid, step_expected, step_actual)
            if logprob is not None:
                assert abs(step_actual[rid][1] - logprob) <= logprob_atol, (rid, logprob, step_actual[rid][1])
                assert step_actual[rid][2] == top
