"""Continuous batching under one rule.

Every request has num_tokens (prompt + generated) and num_computed_tokens (in the KV cache). Each
step hands out a token budget so that computed catches up with total. Prefill, chunked prefill,
decode, prefix hits and recompute after preemption are all that one rule.

A preempted request either recomputes (pages freed, num_computed_tokens back to 0) or, with a swap
tier, keeps its computed tokens in host pages (scheduler.pages.preemption picks the cheaper per victim);
it resumes like any waiting request, its pages copied back into fresh device pages.

The scheduler is owned by a single loop: schedule() -> executor -> update(); nothing else mutates it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from core.errors import AlreadyExists, InvalidArgument
from core.outputs import RequestOutput
from core.sampling import SamplingParams
from core.step import CachedRequestData, NewRequestData, StepPlan, StepResult
from scheduler.config import SchedulerConfig
from scheduler.pages.kv_manager import KVCacheManager, cdiv
from scheduler.latency_targets import LatencyTargets
from scheduler.pages.preemption import RecomputeRate, swap_is_cheaper
from scheduler.queue_policy import make_waiting_queue
from scheduler.request import FINISH_REASONS, Request, RequestStatus
from scheduler.speculation import build_speculation, verified_tokens
from scheduler.stats import SchedulerStats
from scheduler.async_steps import AsyncSteps
from scheduler.worker_loss import WorkerLoss
from scheduler.step_time import ItlTarget, StepTuning


class RequestTooLarge(InvalidArgument):
    """The request could never fit the KV cache, even alone (prompt + max_tokens past every page)."""


@dataclasses.dataclass(slots=True)
class _Step:
    """The step schedule() is planning: what its three parts share."""

    plan: StepPlan
    itl_target: ItlTarget | None  # the tightest ITL target this step's decodes must meet
    budget: int  # tokens still to hand out
    targeted: bool  # a latency target cut the budget below max_num_batched_tokens
    new_block_ids: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # running requests' new pages
    preempted: bool = False  # a running request lost its pages: no new work this step
    # per running request: how many after it (in self.running at the step's start) still need tokens; one pass,
    # not one per request (at 1,024 running requests that sum was 135 ms of each step); a victim preempted
    # later only makes it one too high, so what it holds back for them errs on the safe side
    needing_after: dict[str, int] = dataclasses.field(default_factory=dict)


class Scheduler(WorkerLoss, AsyncSteps):
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock  # the clock of Request.arrival_time (TTFT target) and of step times
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.kv_policy, config.prefix_caching,
                                 config.num_host_blocks, config.sliding_window)
        self.waiting = make_waiting_queue(config.queue_policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._on_worker: set[str] = set()  # requests whose state the worker holds
        self._dropped_since_last_plan: list[str] = []  # the worker must forget these
        self._step_id = 0
        self.num_preemptions = 0
        self.num_swapped_preemptions = 0  # of which swapped rather than recomputed
        self.recompute_rate = RecomputeRate()
        self.latency = LatencyTargets(config)  # each step's budget under --target-itl-ms / --target-ttft-ms
        self.speculation = build_speculation(config)  # draft tokens per decode (--speculative), or None
        self._dropped_tail: dict[str, int] = {}  # pages freed after rejected drafts, not yet told to the worker

    # --- intake -----------------------------------------------------------------------------------

    def check_fits(self, request: Request) -> None:
        """Raises RequestTooLarge when prompt + max_tokens could never fit the KV cache, even alone."""
        needed = self.kv.blocks_needed_at_most(request)
        if needed > self.config.num_blocks:
            raise RequestTooLarge(
                "max_tokens", request.sampling_params.max_tokens,
                f"prompt ({request.num_prompt_tokens}) + max_tokens = "
                f"{request.num_prompt_tokens + request.sampling_params.max_tokens} tokens needs {needed} pages; "
                f"the KV cache has {self.config.num_blocks} pages of {self.config.block_size} tokens")

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise AlreadyExists("request_id", request.request_id)
        for name in ("target_itl_ms", "target_ttft_ms"):
            value = getattr(request, name)
            if value is not None and not 0 < value < float("inf"):
                raise InvalidArgument(name, value, "must be a finite number of milliseconds > 0")
        self.check_fits(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends a request at once and frees its pages; None if it is unknown or already ended."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return self._output(request, [], [])

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- one step ---------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """One step's plan, in three steps: the running requests first (decodes and prefill chunks, preempting
        from the tail for pages), then waiting ones while budget, seats and pages last, then the plan is
        closed (drops, page copies, the latency targets' record of it)."""
        itl_target = self.latency.step_itl_target(self.running)
        budget = self.latency.choose_token_budget(itl_target, self.running, self.waiting, self.clock())
        step = _Step(StepPlan(step_id=self._step_id), itl_target, budget,
                     targeted=budget < self.config.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:  # new work would take the pages the preemption freed back
            self._schedule_waiting(step)
        return self._close_plan(step)

    def _schedule_running(self, step: _Step) -> None:
        # One pass over the running set every step, so the common decode keeps to locals: without speculation
        # a request never sits out, proposes or looks ahead, and needing_after is read only under a target.
        running, speculation, plan = self.running, self.speculation, step.plan
        scheduled, new_block_ids = plan.num_scheduled_tokens, step.new_block_ids
        allocate = self.kv.allocate_slots
        needing_after = step.needing_after = (self._needing_after() if step.targeted or speculation is not None
                                              else {})
        index = 0
        while index < len(running) and step.budget > 0:
            request = running[index]
            num_tokens = request.num_tokens
            num_new = min(num_tokens - request.num_computed_tokens, step.budget)
            if step.targeted and num_new > 1:  # a prefill chunk shrinks so the decodes after it still run
                num_new = max(1, min(num_new, step.budget - needing_after[request.request_id]))
            if num_new == 0 or (request.num_pending_tokens and self._length_reached(request, num_tokens)):
                index += 1  # async scheduling: its step in flight is its last (its newest placeholder ends it)
                continue
            added = None
            if speculation is not None:
                if self._sits_out(request):
                    index += 1  # it cannot be planned past its step in flight
                    continue
                drafts = self._drafts(step, request, num_new)
                lookahead = self._lookahead(request, request.num_computed_tokens, num_new)
                if drafts or lookahead:
                    added = allocate(request, num_new + len(drafts) + lookahead)
                if added is not None:  # speculation takes free pages only: it never preempts
                    if drafts:
                        plan.spec_token_ids[request.request_id] = drafts
                    if lookahead:
                        plan.num_draft_tokens[request.request_id] = lookahead
                    num_new += len(drafts)
            if added is None:
                added = allocate(request, num_new)
                if added is None:
                    added, index = self._allocate_preempting(step, request, num_new, index)
                    if added is None:
                        continue  # the current request was the victim; self.running shifted under index
            scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = added
            step.budget -= num_new
            index += 1
        dropped_tail = self._dropped_tail
        cached = plan.cached_requests
        for request in running:
            request_id = request.request_id
            if request_id in scheduled:
                cached.append(CachedRequestData(request_id, new_block_ids[request_id], request.num_computed_tokens,
                                                dropped_tail.pop(request_id, 0) if dropped_tail else 0))

    def _allocate_preempting(self, step: _Step, request: Request, num_new: int,
                             index: int) -> tuple[list[int] | None, int]:
        """Pages for num_new more tokens of the running request at index, which the pool could not supply, preempting
        victims until they fit: (its new pages, or None when it was the victim itself; index, one back per victim
        that sat before it)."""
        added = None
        while added is None:
            victim = self._pick_victim()
            step.preempted = True
            if victim.request_id in step.plan.num_scheduled_tokens:
                step.budget += step.plan.num_scheduled_tokens.pop(victim.request_id)
                step.plan.spec_token_ids.pop(victim.request_id, None)
                step.plan.num_draft_tokens.pop(victim.request_id, None)
                step.new_block_ids.pop(victim.request_id, None)
                index -= 1  # it sat before the current request
            self._preempt(victim)
            if victim is request:
                return None, index
            added = self.kv.allocate_slots(request, num_new)
        return added, index

    def _drafts(self, step: _Step, request: Request, num_new: int) -> list[int]:
        """Draft tokens for a running request that decodes one token this step (speculative
        decoding): as many as its proposer offers, within what the step's budget leaves once every running
        request after it has its own token (drafts never crowd out another request's decode), and what
        max_tokens and the model length leave after its token, so no accepted token can run past either."""
        if self.speculation is None or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        limit = min(request.sampling_params.max_tokens - request.num_output_tokens - 1,
                    self.config.max_model_len - request.num_tokens - 1)
        if limit >= 1:
            limit = min(limit, step.budget - 1 - step.needing_after[request.request_id])
        return self.speculation.drafts(request, limit)

    def _lookahead(self, request: Request, num_computed: int, num_new: int) -> int:
        """Slots past this step's tokens where the worker's draft model writes its K/V for the guesses it makes
        after the step (--speculative draft), for a request that samples this step; 0 otherwise. No more than the
        next step could verify: after this step's token, max_tokens and the model length leave 1 less."""
        if self.speculation is None or request.num_tokens - num_computed != num_new:
            return 0
        next_limit = min(request.sampling_params.max_tokens - request.num_output_tokens - 2,
                         self.config.max_model_len - request.num_tokens - 2)
        return max(0, min(self.speculation.lookahead(request), next_limit))

    def _schedule_waiting(self, step: _Step) -> None:
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.latency.next_waiting(self.waiting)
            if request.num_pending_tokens:
                break  # preempted while its step is in flight: sent in full once its token is known
            swapped = self.kv.is_swapped(request.request_id)
            # prompt logprobs need every prompt position's logits: no prefix-cache reads until they are
            # all computed (vLLM's choice); its pages still enter the cache for the requests after it
            cached = [] if swapped or request.needs_prompt_logprobs else self.kv.find_cached_prefix(request)
            num_cached_tokens = request.num_computed_tokens if swapped else len(cached) * self.config.block_size
            num_new = min(request.num_tokens - num_cached_tokens, step.budget)
            if step.targeted and self.running:
                num_new = self.latency.admissible_tokens(step.plan, num_new, num_cached_tokens + num_new,
                                                         step.itl_target, self.running)
                if num_new < 1:
                    break  # the running set is as large as the ITL target allows
            # a prompt that completes here gets the draft's lookahead when pages are free (never a swapped one:
            # its pages come back as they were)
            lookahead = 0 if swapped else self._lookahead(request, num_cached_tokens, num_new)
            if lookahead and self.kv.allocate_slots(request, num_new + lookahead, cached) is not None:
                step.plan.num_draft_tokens[request.request_id] = lookahead
            elif self.kv.allocate_slots(request, num_new, cached) is None:
                break  # the head waits for pages; FCFS does not let later requests overtake it
            self._start_running(step, request, swapped, num_cached_tokens, num_new)

    def _start_running(self, step: _Step, request: Request, swapped: bool, num_cached_tokens: int,
                       num_new: int) -> None:
        """The waiting request, its pages allocated, joins the running set and the plan in full."""
        if swapped:
            self.kv.swap_in(request)
        if request is self.waiting.peek():
            self.waiting.pop()
        else:  # a TTFT target put it ahead of the head
            self.waiting.remove(request)
        request.num_computed_tokens = num_cached_tokens
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._on_worker.add(request.request_id)
        self._dropped_tail.pop(request.request_id, None)  # the worker gets its whole table
        step.plan.new_requests.append(NewRequestData(
            request_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=self._worker_sampling_params(request),
            block_ids=list(self.kv.block_table(request.request_id)),
            num_computed_tokens=num_cached_tokens,
            trace_context=request.trace_context,
        ))
        step.plan.num_scheduled_tokens[request.request_id] = num_new
        step.budget -= num_new

    def _close_plan(self, step: _Step) -> StepPlan:
        plan = step.plan
        if not plan.is_empty:  # an empty plan is never sent, so the drops and copies wait for the next one
            plan.finished_request_ids = self._dropped_since_last_plan
            plan.swap_out, plan.swap_in = self.kv.take_copies()
            self._dropped_since_last_plan = []
            num_context_tokens = sum(self.requests[request_id].num_computed_tokens + num_tokens
                                     for request_id, num_tokens in plan.num_scheduled_tokens.items())
            self.latency.planned(plan, num_context_tokens, step.itl_target, self.clock())
            self._step_id += 1
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Applies a step's result; returns a delta for every request that produced a token or ended."""
        self._observe_step(plan, result)
        outputs = []
        for request_id, num_scheduled in plan.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            drafts = plan.spec_token_ids.get(request_id)
            if drafts is not None:
                outputs.extend(self._apply_verified(request, num_scheduled, drafts, result))
                continue
            request.num_computed_tokens += num_scheduled
            self._gather_prompt_logprobs(request, result)
            token_id = result.sampled_token_ids.get(request_id)
            if token_id is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            request.append_output_token(token_id)
            logprobs = result.logprobs.get(request_id)
            status = self._stop_status(request, token_id)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            outputs.append(self._output(request, [token_id], [logprobs] if logprobs else []))
        for request_id, drafts in result.draft_token_ids.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING and self.speculation is not None:
                self.speculation.keep_worker_drafts(request, drafts)
        return outputs

    def _apply_verified(self, request: Request, num_scheduled: int, drafts: list[int],
                        result: StepResult) -> list[RequestOutput]:
        """A decode that verified drafts: its accepted drafts and the worker's own token join its tokens one by
        one, stop conditions checked after each (nothing past a stop is kept); the rejected drafts' slots
        no longer count as computed, and pages only they had written go back to the pool."""
        tokens, logprobs = verified_tokens(request.request_id, drafts, result)
        num_accepted = len(tokens) - 1
        request.num_computed_tokens += num_scheduled - (len(drafts) - num_accepted)
        self.speculation.observe(request, len(drafts), num_accepted)
        emitted = []
        for token in tokens:
            request.append_output_token(token)
            emitted.append(token)
            status = self._stop_status(request, token)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                break
        else:
            self._dropped_tail[request.request_id] = (self._dropped_tail.get(request.request_id, 0)
                                                      + self.kv.free_tail(request))
        return [self._output(request, emitted, logprobs[:len(emitted)])]

    @staticmethod
    def _gather_prompt_logprobs(request: Request, result: StepResult) -> None:
        chunk = result.prompt_logprobs.get(request.request_id)
        if chunk is not None:
            request.add_prompt_logprobs(chunk)

    @staticmethod
    def _worker_sampling_params(request: Request) -> SamplingParams:
        """What the worker gets: without prompt_logprobs once they are all gathered (a request resumed
        after a preemption does not compute them again)."""
        params = request.sampling_params
        if params.prompt_logprobs is not None and not request.needs_prompt_logprobs:
            return dataclasses.replace(params, prompt_logprobs=None)
        return params

    def _observe_step(self, plan: StepPlan, result: StepResult) -> None:
        self.recompute_rate.observe(plan.total_num_scheduled_tokens, result.forward_ns)
        self.latency.observe(plan, result, self.clock())

    def pop_step_tuning(self, step_id: int) -> StepTuning | None:
        """The step's tuning record (latency targets; observed once its result was applied); forgotten once read."""
        return self.latency.pop_step_tuning(step_id)

    def _needing_after(self) -> dict[str, int]:
        counts, after = {}, 0
        for request in reversed(self.running):
            counts[request.request_id] = after
            after += request.num_tokens > request.num_computed_tokens and not request.verifying  # it sits out
        return counts

    # --- helpers ----------------------------------------------------------------------------------

    def _length_reached(self, request: Request, num_tokens: int) -> bool:
        return (num_tokens - request.num_prompt_tokens >= request.sampling_params.max_tokens
                or num_tokens >= self.config.max_model_len)

    def _stop_status(self, request: Request, token_id: int, num_tokens: int | None = None) -> RequestStatus | None:
        """num_tokens: the request's length up to and including token_id (default: all of it)."""
        params = request.sampling_params
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if self._length_reached(request, request.num_tokens if num_tokens is None else num_tokens):
            return RequestStatus.FINISHED_LENGTH
        return None

    def _pick_victim(self) -> Request:
        # not one verifying drafts in flight: its tokens would land on pages it no longer has (the request
        # being planned never is one, so there is always a victim)
        if self.config.queue_policy == "priority":
            return max((r for r in self.running if not r.verifying), key=lambda r: (r.priority, r.arrival_time))
        return next(r for r in reversed(self.running) if not r.verifying)

    def _preempt(self, request: Request) -> None:
        # Swap: its computed pages move to the host tier and it resumes where it was. Recompute: the
        # pages go back (their content stays findable in the prefix cache) and it restarts from
        # num_computed_tokens = 0. Either way it waits at the head of the queue.
        self.running.remove(request)
        if self._swap_is_cheaper(request) and self.kv.swap_out(request):
            self.num_swapped_preemptions += 1
        else:
            self.kv.free(request)
            request.num_computed_tokens = 0
        self._drop_from_worker(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(request)

    def _swap_is_cheaper(self, request: Request) -> bool:
        if not self.config.num_host_blocks:
            return False
        num_pages = cdiv(request.num_computed_tokens, self.config.block_size)
        return swap_is_cheaper(request.num_computed_tokens, num_pages, self.config.bytes_per_block,
                               self.config.swap_bytes_per_s, self.recompute_rate)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finish_reason = FINISH_REASONS[status]
        self.kv.free(request)
        request.drop_pending_tokens()  # async scheduling: the steps in flight no longer count for it
        self._drop_from_worker(request.request_id)
        del self.requests[request.request_id]

    def _drop_from_worker(self, request_id: str) -> None:
        self._dropped_tail.pop(request_id, None)  # its pages went with it
        if request_id in self._on_worker:
            self._on_worker.discard(request_id)
            self._dropped_since_last_plan.append(request_id)

    def _output(self, request: Request, token_ids: list[int], logprobs: list) -> RequestOutput:
        prompt_logprobs = None
        if token_ids and request.sampling_params.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens - request.num_pending_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_preemptions=request.num_preemptions,
        )

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_waiting_tokens=sum(r.num_tokens - r.num_computed_tokens for r in self.waiting),
            num_blocks=self.config.num_blocks,
            num_used_blocks=self.kv.pool.num_used,
            kv_utilization=self.kv.utilization(self.running),
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            step_id=self._step_id,
            num_swapped_preemptions=self.num_swapped_preemptions,
            token_budget=self.latency.token_budget,
            step_time_error_s=self.latency.step_time.last_error_s,
            itl_target_headroom=self.latency.headroom,
            num_itl_target_misses=self.latency.num_itl_target_misses,
            num_swapped=len(self.kv.host_tables),
            num_host_blocks=self.config.num_host_blocks,
            num_used_host_blocks=self.kv.host_pool.num_used,
            **(self.speculation.stats() if self.speculation is not None else {}),
        )
