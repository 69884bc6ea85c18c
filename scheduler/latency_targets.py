"""Latency targets: each step's token budget and running-set size under --target-itl-ms /
--target-ttft-ms (and the per-API-key targets requests carry), from the step-time model it learns.

The scheduler asks, once per step: which ITL target governs it (step_itl_target), how many tokens it
may compute (choose_token_budget), which waiting request goes first (next_waiting) and how many
tokens one more request may add (admissible_tokens); it reports each plan it sends (planned) and each
result (observe), from which the model learns and the misses are counted. Time comes in as `now` from
the scheduler's clock, so nothing here reads a clock of its own.

A target is an inter-token P99, while the model predicts a step's mean time: steps of one shape spread
around it (other processes on the cores, the machine's load changing faster than the fit). So plans aim
at `headroom` times the target, where the headroom is one over the RATIO_PERCENTILE-th percentile of
observed / predicted time over the last RATIO_WINDOW binding steps: those an ITL target governed whose
prediction reached BINDING_SHARE of it. A step planned at the limit, headroom * target, misses when its
ratio exceeds 1 / headroom: reading the headroom off that percentile lets 100 - RATIO_PERCENTILE % of
such steps, and fewer gaps, over the target. Read from a window, it follows the machine within
a window's steps, both ways (an up-and-down miss tracker, tried before, moved by 10 % on each rare
miss and took 1 / (miss rate) steps to undo one: longer than a load level, so its headroom was that of
the history before it, 0.95 in one 32-stream level whose P99 went 4 % over the target).
Steps far under the target do not count: a decode that took three times its prediction but stayed a
quarter of the target says nothing of the spread of full steps (a margin over every step's ratio, tried
first, cut every plan to a quarter on a shared 2-core machine, down to one running request). Nor does a
step that ran over STALL_RATIO times its prediction: no smaller plan would have avoided that stall (or
the model had not yet learnt the step's shape, which its fit is correcting), and counting such steps
drove the plans to the floor while other processes held the cores.

An ITL target governs only steps that decode someone (a running request that has had a token): a step
of prefills alone delays first tokens, not the gap between two, so it gets the whole budget.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable, Sequence

from core.percentile import percentile
from core.step import StepPlan, StepResult
from scheduler.config import SchedulerConfig
from scheduler.queue_policy import WaitingQueue
from scheduler.request import Request, RequestStatus
from scheduler.step_time import (
    ITL_FROM_FLAG,
    ITL_FROM_REQUEST,
    STALL_RATIO,
    ItlTarget,
    StepShape,
    StepTimeModel,
    StepTuning,
)

# The share of an ITL target plans aim at: TARGET_HEADROOM until MIN_RATIOS binding steps were seen,
# then read from their spread, within MIN_HEADROOM..MAX_HEADROOM (the rest of MAX_HEADROOM is for what
# no step time shows: the loop's turn between a result and the next plan, ~1 ms). A TTFT target is
# planned against TARGET_HEADROOM of itself.
TARGET_HEADROOM = 0.8
MIN_HEADROOM, MAX_HEADROOM = 0.2, 0.95
RATIO_PERCENTILE = 99.5  # of binding steps' ratios, kept under the target: P99 of the gaps, with room
RATIO_WINDOW = 256  # binding steps the quantile is read over (~30 s at 32 streams on 2 cores)
MIN_RATIOS = 32
# a step binds when its prediction reached this share of the target (of the target, not of the plan: a
# threshold that fell with the headroom let 3-times-slow decodes in once it fell, which held it down)
BINDING_SHARE = 0.5
KEPT_STEP_TUNINGS = 8  # steps whose tuning record waits for the loop's span (two are in flight at most)


class LatencyTargets:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.step_time = StepTimeModel()
        # steps sent, not yet observed: (shape, planned at, the ITL target that governed it, its prediction)
        self._step_shapes: dict[int, tuple[StepShape, float, ItlTarget | None, float | None]] = {}
        self.headroom = TARGET_HEADROOM  # plans aim at this share of the ITL target
        self._ratios: deque[float] = deque(maxlen=RATIO_WINDOW)  # observed / predicted, of binding steps
        self.step_tunings: dict[int, StepTuning] = {}  # the same steps' decisions, observed ones kept until read
        self.token_budget = config.max_num_batched_tokens  # the latest step's
        self.num_itl_target_misses = 0

    # --- what governs a step ------------------------------------------------------------------------

    def step_itl_target(self, running: Sequence[Request]) -> ItlTarget | None:
        """The tightest ITL target among the running requests that have had a token (the ones whose
        next gap this step makes): each one's own (its API key's class of service), else the
        scheduler's flag. None when none has: prefills alone wait for no gap. On a tie the flag's wins,
        so without per-request targets this is exactly the flag."""
        flag = self.config.target_itl_ms
        if flag is None and not any(request.target_itl_ms is not None for request in running):
            return None  # nothing governs any gap (the common case: read every step, so no list is built)
        decoding = [request for request in running if request.num_output_tokens > 0]
        if not decoding:
            return None
        targets = [ItlTarget(flag, ITL_FROM_FLAG)] if flag is not None else []
        if any(request.target_itl_ms is not None for request in decoding):
            if all(request.target_itl_ms is not None for request in decoding):
                targets = []  # every decoding request brought its own class: the flag governs none of them
            targets += [ItlTarget(request.target_itl_ms, ITL_FROM_REQUEST)
                        for request in decoding if request.target_itl_ms is not None]
        return min(targets, key=lambda target: (target.ms, target.source != ITL_FROM_FLAG), default=None)

    def choose_token_budget(self, itl_target: ItlTarget | None, running: Sequence[Request],
                            waiting: WaitingQueue, now: float) -> int:
        """max_num_batched_tokens, or less when the ITL target says so (never below one token per
        running request: decodes always progress; the running set is what admission keeps small).
        Kept as token_budget, the latest step's."""
        self.token_budget = self._token_budget(itl_target, running, waiting, now)
        return self.token_budget

    def _token_budget(self, itl_target: ItlTarget | None, running: Sequence[Request],
                      waiting: WaitingQueue, now: float) -> int:
        ceiling = self.config.max_num_batched_tokens
        if itl_target is None or self._ttft_at_risk(waiting, now):
            return ceiling
        context = sum(request.num_tokens for request in running)
        allowed = self.step_time.max_tokens_within(self._plan_s(itl_target), len(running), context)
        if allowed is None:
            return ceiling
        return min(ceiling, max(allowed, len(running), 1))

    def admissible_tokens(self, plan: StepPlan, num_new: int, num_context: int, itl_target: ItlTarget,
                          running: Iterable[Request]) -> int:
        """num_new, cut to what one more request in this step may compute under the ITL target (< 1: none)."""
        allowed = self.step_time.max_tokens_within(
            self._plan_s(itl_target), len(plan.num_scheduled_tokens) + 1,
            sum(request.num_tokens for request in running) + num_context)
        return num_new if allowed is None else min(num_new, allowed - plan.total_num_scheduled_tokens)

    def _plan_s(self, itl_target: ItlTarget) -> float:
        """The predicted step time a plan may reach under itl_target."""
        return itl_target.ms / 1e3 * self.headroom

    # --- TTFT targets: who is admitted first, and when a prefill gets the full budget ---------------

    def _ttft_target_ms(self, request: Request) -> float | None:
        return request.target_ttft_ms if request.target_ttft_ms is not None else self.config.target_ttft_ms

    def next_waiting(self, waiting: WaitingQueue) -> Request:
        """The head of the queue, unless a waiting request carries its own TTFT target (its API key's
        class of service): then the one nearest its TTFT deadline (arrival + its target, or the flag's)
        goes first, requests without any target after them in queue order. With FCFS a preempted
        request stays ahead of all (it was admitted before them); with priority, priority ranks first."""
        if not waiting.num_ttft_targeted:
            return waiting.peek()
        fcfs = self.config.queue_policy == "fcfs"

        def urgency(entry: tuple[int, Request]) -> tuple:
            index, request = entry
            target_ms = self._ttft_target_ms(request)
            deadline = float("inf") if target_ms is None else request.arrival_time + target_ms / 1e3
            return (not (fcfs and request.status == RequestStatus.PREEMPTED),
                    0 if fcfs else request.priority, deadline, index)

        return min(enumerate(waiting), key=urgency)[1]

    def _ttft_at_risk(self, waiting: WaitingQueue, now: float) -> bool:
        """The next waiting request would miss its TTFT target unless its prefill runs now."""
        if not waiting or not self.step_time.ready:
            return False
        head = self.next_waiting(waiting)
        target_ms = self._ttft_target_ms(head)
        if target_ms is None:
            return False
        prefill_s = self.step_time.predict_s(StepShape(head.num_tokens, 1, head.num_tokens))
        return (now - head.arrival_time + prefill_s) * 1e3 >= target_ms * TARGET_HEADROOM

    # --- learning from the steps --------------------------------------------------------------------

    def planned(self, plan: StepPlan, num_context_tokens: int, itl_target: ItlTarget | None, now: float) -> None:
        """A plan is being sent: its shape and the decision are kept until its result comes in."""
        shape = StepShape(plan.total_num_scheduled_tokens, len(plan.num_scheduled_tokens), num_context_tokens)
        predicted_s = self.step_time.predict_s(shape) if self.step_time.ready else None
        self._step_shapes[plan.step_id] = (shape, now, itl_target, predicted_s)
        self.step_tunings[plan.step_id] = StepTuning(self.token_budget, predicted_s, itl_target=itl_target)
        self.step_tunings.pop(plan.step_id - KEPT_STEP_TUNINGS, None)  # nobody read it (no tracing)

    def observe(self, plan: StepPlan, result: StepResult, now: float) -> None:
        planned = self._step_shapes.pop(plan.step_id, None)
        if planned is None or result.forward_ns <= 0:
            return  # untimed (a fake executor)
        shape, planned_at, itl_target, predicted_s = planned
        # what a decoding request waits for: the forward pass, and around it the plan's trip to the
        # worker, sampling and the result's trip back (with async scheduling also the end of the step
        # before, which makes the model err on the safe side)
        seconds = max(result.forward_ns / 1e9, now - planned_at)
        self.step_time.observe(shape, seconds)
        tuning = self.step_tunings.get(plan.step_id)
        if tuning is not None:
            tuning.observed_s = seconds
        missed = itl_target is not None and seconds * 1e3 > itl_target.ms
        if missed:
            self.num_itl_target_misses += 1
            if tuning is not None:
                tuning.target_missed = True
        binding = (itl_target is not None and predicted_s is not None
                   and predicted_s >= BINDING_SHARE * itl_target.ms / 1e3)
        if binding and seconds <= STALL_RATIO * predicted_s:
            self._ratios.append(seconds / predicted_s)
            if len(self._ratios) >= MIN_RATIOS:
                spread = percentile(self._ratios, RATIO_PERCENTILE)
                self.headroom = min(max(1.0 / spread, MIN_HEADROOM), MAX_HEADROOM)

    def pop_step_tuning(self, step_id: int) -> StepTuning | None:
        """The step's tuning record (observed once its result was applied); forgotten once read."""
        return self.step_tunings.pop(step_id, None)

    def forget_steps_in_flight(self) -> None:
        """The worker was lost with them: nothing to learn from those steps."""
        self._step_shapes.clear()
        self.step_tunings.clear()
