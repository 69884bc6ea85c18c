"""The step-time model behind latency targets: how long a step takes, learnt online while serving.

    step time ~ a + b * scheduled tokens + c * requests in the step + d * context tokens / 1000

fitted by recursive least squares with forgetting (recent steps weigh more, so the fit follows the
machine as its load changes), from each step's time from planning to its result (the forward pass
the worker reports, or more when the trip to the worker and back adds to it). With a target
the scheduler asks it for the largest token budget whose predicted step time stays under the target
(prefill chunks shrink first: decodes are planned before them) and whether one more request still
fits (the running-set size). Until MIN_OBSERVATIONS steps have been seen it predicts nothing and the
scheduler keeps its fixed budget.

Targets are also a class of service: a request may carry its API key's own (GenerationRequest
target_itl_ms / target_ttft_ms). A step's ITL target is then the tightest among its running requests'
(each request's own, else the scheduler's flag), and waiting requests with TTFT targets are admitted
nearest-deadline first.
"""
from __future__ import annotations

from dataclasses import dataclass

FORGETTING = 0.98  # per step: an observation 50 steps old weighs ~0.36 of a new one
MIN_OBSERVATIONS = 8
NUM_FEATURES = 4


@dataclass(slots=True, frozen=True)
class StepShape:
    num_tokens: int  # tokens computed in the step
    num_requests: int  # requests in the step
    num_context_tokens: int  # sum of their context lengths after the step (what attention reads)

    def features(self) -> list[float]:
        return [1.0, float(self.num_tokens), float(self.num_requests), self.num_context_tokens / 1000.0]


@dataclass(slots=True, frozen=True)
class ItlTarget:
    """The inter-token target that governs a step: the tightest among the requests it decodes."""

    ms: float
    source: str  # ITL_FROM_FLAG (the scheduler's --target-itl-ms) or ITL_FROM_REQUEST (its API key's class)


ITL_FROM_FLAG = "scheduler"
ITL_FROM_REQUEST = "api_key"


@dataclass(slots=True)
class StepTuning:
    """What the latency targets decided for one step and how it went: span attributes of scheduler.step."""

    token_budget: int
    predicted_s: float | None  # None while the model is not fitted
    observed_s: float | None = None  # planning to result (at least the worker's forward time), once it is in
    target_missed: bool = False
    itl_target: ItlTarget | None = None  # what governed the step; None: no ITL target


class StepTimeModel:
    def __init__(self) -> None:
        self.weights = [0.0] * NUM_FEATURES  # seconds per feature unit
        # inverse covariance of the features, large at first (nothing known)
        self._p = [[1e3 if i == j else 0.0 for j in range(NUM_FEATURES)] for i in range(NUM_FEATURES)]
        self.num_observations = 0
        self.last_error_s = 0.0  # observed - predicted of the latest step (before it was learnt)

    @property
    def ready(self) -> bool:
        return self.num_observations >= MIN_OBSERVATIONS

    def predict_s(self, shape: StepShape) -> float:
        return max(sum(w * x for w, x in zip(self.weights, shape.features())), 0.0)

    def observe(self, shape: StepShape, seconds: float) -> None:
        """One recursive least-squares update with forgetting."""
        x = shape.features()
        self.last_error_s = seconds - self.predict_s(shape)
        px = [sum(self._p[i][j] * x[j] for j in range(NUM_FEATURES)) for i in range(NUM_FEATURES)]
        denominator = FORGETTING + sum(x[i] * px[i] for i in range(NUM_FEATURES))
        gain = [value / denominator for value in px]
        residual = seconds - sum(w * v for w, v in zip(self.weights, x))
        self.weights = [w + g * residual for w, g in zip(self.weights, gain)]
        self._p = [[(self._p[i][j] - gain[i] * px[j]) / FORGETTING for j in range(NUM_FEATURES)]
                   for i in range(NUM_FEATURES)]
        self.num_observations += 1

    def max_tokens_within(self, target_s: float, num_requests: int, num_context_tokens: int) -> int | None:
        """The most tokens a step of num_requests requests over num_context_tokens may compute and still
        be predicted under target_s; None when the fit says nothing (not ready, or tokens cost nothing)."""
        per_token = self.weights[1]
        if not self.ready or per_token <= 0:
            return None
        fixed = self.predict_s(StepShape(0, num_requests, num_context_tokens))
        return max(int((target_s - fixed) / per_token), 0)
