"""The step-time model behind latency targets: how long a step takes, learnt online while serving.

    step time ~ a + b * scheduled tokens + c * requests in the step + d * context tokens / 1000

fitted by least squares over the last WINDOW steps (recent steps only, so the fit follows the machine as
its load changes), each weight at least 0 (no step gets cheaper for holding more), from each step's
time from planning to its result (the forward pass the worker reports, or more when the trip to the
worker and back adds to it). A feature the window's steps did not vary apart from the ones before it
(every step one request, or decodes alone, where requests and tokens move together) says nothing about
its own cost: its weight stays what it was when the steps last varied it (0 at first), instead of
taking up noise in a direction the data does not pin down (a recursive fit over single-request steps
on a shared CPU put 51 ms on each request and -0.38 s on each 1000 context tokens, and so predicted
790 ms for 32 decodes that took 290 ms). With a target the scheduler
asks it for the largest token budget whose predicted step time stays under the target (prefill chunks
shrink first: decodes are planned before them) and whether one more request still fits (the
running-set size). Until MIN_OBSERVATIONS steps have been seen it predicts nothing and the scheduler
keeps its fixed budget.

Targets are also a class of service: a request may carry its API key's own (GenerationRequest
target_itl_ms / target_ttft_ms). A step's ITL target is then the tightest among its running requests'
(each request's own, else the scheduler's flag), and waiting requests with TTFT targets are admitted
nearest-deadline first.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW = 256  # steps the fit is made over
MIN_OBSERVATIONS = 8
NUM_FEATURES = 4
# how much a feature must vary over the window, apart from the features before it, for the fit to learn
# its weight (the root mean square of what they do not explain of it): tokens, requests, context (in
# thousands of tokens); the intercept is always fitted
MIN_RMS = (0.0, 2.0, 1.0, 0.5)
# A step that ran more than this many times its prediction is learnt as this many times it: a stall
# (another process on the cores: 8 decodes of 50 ms took 1.7 s on the shared CPU) must not drag the fit
# of every step up, while a shape the fit has underrated still pulls it up threefold a step
STALL_RATIO = 3.0

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
        self.num_observations = 0
        self.last_error_s = 0.0  # observed - predicted of the latest step (before it was learnt)
        self._window: deque[tuple[list[float], float]] = deque()
        # sums over the window, kept as steps come and go: features x features, features x seconds
        self._gram = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
        self._moment = [0.0] * NUM_FEATURES

    @property
    def ready(self) -> bool:
        return self.num_observations >= MIN_OBSERVATIONS

    def predict_s(self, shape: StepShape) -> float:
        return max(sum(w * x for w, x in zip(self.weights, shape.features())), 0.0)

    def observe(self, shape: StepShape, seconds: float) -> None:
        predicted_s = self.predict_s(shape)
        self.last_error_s = seconds - predicted_s
        if self.ready and predicted_s > 0:
            seconds = min(seconds, STALL_RATIO * predicted_s)
        self._add(shape.features(), seconds, +1.0)
        self._window.append((shape.features(), seconds))
        if len(self._window) > WINDOW:
            self._add(*self._window.popleft(), -1.0)
        self.num_observations += 1
        if self.num_observations % WINDOW == 0:  # start the sums afresh now and then: no rounding drift
            self._gram = [[0.0] * NUM_FEATURES for _ in range(NUM_FEATURES)]
            self._moment = [0.0] * NUM_FEATURES
            for x, y in self._window:
                self._add(x, y, +1.0)
        self._fit()

    def _add(self, x: list[float], seconds: float, sign: float) -> None:
        for i in range(NUM_FEATURES):
            self._moment[i] += sign * x[i] * seconds
            for j in range(NUM_FEATURES):
                self._gram[i][j] += sign * x[i] * x[j]

    def _fit(self) -> None:
        """Non-negative least squares over the window's learnable features (the others held at their
        weights): the best of the exact solutions on every subset of them whose weights are all >= 0."""
        learnable = [0]
        for feature in range(1, NUM_FEATURES):
            if self._independent_rms(feature, learnable) >= MIN_RMS[feature]:
                learnable.append(feature)
        held = [i for i in range(NUM_FEATURES) if i not in learnable]
        # the seconds the held features explain come off the moments
        moment = {i: self._moment[i] - sum(self._gram[i][j] * self.weights[j] for j in held) for i in learnable}
        best, best_cost = None, 0.0  # all-zero weights cost 0 in the objective below
        for mask in range(1, 1 << len(learnable)):
            subset = [feature for bit, feature in enumerate(learnable) if mask >> bit & 1]
            solution = _solve([[self._gram[i][j] for j in subset] for i in subset], [moment[i] for i in subset])
            if solution is None or min(solution) < 0:
                continue
            # squared error up to a constant: w' G w - 2 w' m
            cost = sum(solution[a] * solution[b] * self._gram[i][j] for a, i in enumerate(subset)
                       for b, j in enumerate(subset)) - 2 * sum(w * moment[i] for w, i in zip(solution, subset))
            if best is None or cost < best_cost:
                best, best_cost = dict(zip(subset, solution)), cost
        for i in learnable:
            self.weights[i] = (best or {}).get(i, 0.0)

    def _independent_rms(self, feature: int, others: list[int]) -> float:
        """The RMS over the window of what the other features do not explain of this one."""
        projection = _solve([[self._gram[i][j] for j in others] for i in others], [self._gram[i][feature] for i in others])
        if projection is None:
            return 0.0
        residual = self._gram[feature][feature] - sum(p * self._gram[i][feature] for p, i in zip(projection, others))
        return (max(residual, 0.0) / self._gram[0][0]) ** 0.5

    def max_tokens_within(self, target_s: float, num_requests: int, num_context_tokens: int) -> int | None:
        """The most tokens a step of num_requests requests over num_context_tokens may compute and still
        be predicted under target_s; None when the fit says nothing (not ready, or tokens cost nothing)."""
        per_token = self.weights[1]
        if not self.ready or per_token <= 0:
            return None
        fixed = self.predict_s(StepShape(0, num_requests, num_context_tokens))
        return max(int((target_s - fixed) / per_token), 0)


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float] | None:
    """matrix @ x = vector by Gaussian elimination with partial pivoting; None when (nearly) singular."""
    size = len(vector)
    rows = [row[:] + [value] for row, value in zip(matrix, vector)]
    scale = max(abs(rows[i][i]) for i in range(size)) or 1.0
    for column in range(size):
        pivot = max(range(column, size), key=lambda r: abs(rows[r][column]))
        if abs(rows[pivot][column]) <= 1e-12 * scale:
            return None
        rows[column], rows[pivot] = rows[pivot], rows[column]
        for r in range(column + 1, size):
            factor = rows[r][column] / rows[column][column]
            for c in range(column, size + 1):
                rows[r][c] -= factor * rows[column][c]
    solution = [0.0] * size
    for r in reversed(range(size)):
        solution[r] = (rows[r][size] - sum(rows[r][c] * solution[c] for c in range(r + 1, size))) / rows[r][r]
    return solution
