"""Executes StepPlans: the worker's side of scheduler.executor.Executor.

The runner keeps its own copy of each request's tokens (sent in full once, then extended by the
tokens it samples) and block table (extended by the plan's diffs). Each step packs the scheduled
tokens of all requests into one flat StepBatch, runs the model once, and samples one token for every
request whose computed count reaches its token count (mid-prefill chunks sample nothing).

How the batch is computed is the execution path's business (worker.paths.base: torch or Triton,
chosen once when the runner is built); nothing here depends on which one runs.

A step is prepare()d (plan state applied, batch packed, the path's host-side inputs built: plain
Python, no torch op, so the RPC thread never starts an OpenMP team of its own) and then run().
With the scheduler's async scheduling, the worker service prepares step N+1 on its RPC thread while
the compute thread runs step N: a decode row whose input is the token step N samples is packed as a
placeholder and filled in by run(), which comes after step N's run() on the same thread (on CUDA the
Triton path also writes it on the device, from step N's ids that never left it).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from core.sampling import SamplingParams
from core.step import PLACEHOLDER_TOKEN_ID, NewRequestData, PromptLogprobs, StepPlan, StepResult, TokenLogprobs
from worker.draft_model import DraftModel, DraftWork, first_to_compute
from worker.model.attention import DECODE_GROUP_BYTES
from worker.model.config import ModelConfig
from worker.model.kv_cache import HostSwapSpace, allocate_kv_cache
from worker.model.kv_quant import kv_cache_dtype
from worker.model.llama import LlamaModel
from worker.options import WorkerOptions
from worker.parallel.ranks import Parallel
from worker.parallel.step_mirror import LeaderPath, LeaderSwapSpace
from worker.paths import build_execution_path
from worker.paths.base import StepInputs, resolve_execution
from worker.sampling.sampler import SamplingRow, prompt_logprobs
from worker.sampling.speculative import verify
from worker.sampling.structured_output import StructuredOutput
from worker.step_batch import RequestSpan, StepBatch

if TYPE_CHECKING:
    import llguidance


# a verifying request's outcome: (accepted drafts, the token after them, logprobs of those tokens if it asks)
Verdict = tuple[list[int], int, "list[TokenLogprobs] | None"]


class PlanMismatchError(RuntimeError):
    """The plan disagrees with the runner's copy of a request (a scheduler/worker bookkeeping bug)."""


@dataclass(slots=True)
class RunnerRequestState:
    token_ids: list[int]  # prompt + outputs; the runner appends what it samples
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_table: list[int]
    num_computed_tokens: int  # in the cache, or scheduled by a step already prepared
    num_pending_tokens: int = 0  # tokens that prepared steps will sample and have not yet
    # position of a pending token -> (step id, its index among that step's sampled tokens)
    pending_sources: dict[int, tuple[int, int]] = field(default_factory=dict)
    # constrained decoding: the grammar matcher at token_ids' end (worker.sampling.structured_output); None: unconstrained
    matcher: llguidance.LLMatcher | None = None
    # with a draft model (worker.draft_model): positions 0 .. this - 1 hold the draft's K/V of these tokens, and
    # the next positions its K/V of its last guesses (these inputs), right where the target accepted them
    num_draft_computed: int = 0
    draft_guess_inputs: list[int] = field(default_factory=list)

    @property
    def num_planned_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens


@dataclass(slots=True)
class PreparedStep:
    step_id: int
    batch: StepBatch | None = None  # None: an empty plan
    sampling_ids: list[str] = field(default_factory=list)  # requests that sample this step, batch order
    sampling_states: list[RunnerRequestState] = field(default_factory=list)  # theirs, held past a drop
    placeholder_tokens: list[tuple[RunnerRequestState, int]] = field(default_factory=list)  # (request, position) per placeholder row
    inputs: StepInputs | None = None  # what the execution path's prepare() returned
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # the plan's page copies, made before forward
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # prompt logprobs (SamplingParams.prompt_logprobs), one entry per batch.prompt_logprob_rows row: the
    # prompt token it predicts and the alternatives wanted; per request: (id, first position, count)
    prompt_logprob_targets: list[int] = field(default_factory=list)
    prompt_logprob_top: list[int] = field(default_factory=list)
    prompt_logprob_spans: list[tuple[str, int, int]] = field(default_factory=list)
    # speculative decoding: the requests that verify drafts this step, batch order (batch.verify_rows' owners)
    verify_ids: list[str] = field(default_factory=list)
    verify_states: list[RunnerRequestState] = field(default_factory=list)
    verify_drafts: list[list[int]] = field(default_factory=list)
    # with a draft model: every scheduled request, batch order, and the draft tokens the plan asks it to guess
    draft_requests: list[tuple[str, RunnerRequestState, int]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        decode_group_bytes: int = DECODE_GROUP_BYTES,  # K+V gathered per decode group (torch path, worker.model.attention)
        options: WorkerOptions = WorkerOptions(),  # kernel backend, CUDA graphs, stream overlap
        num_host_blocks: int = 0,  # pages of the host swap tier (worker.model.kv_cache.HostSwapSpace)
        parallel: Parallel | None = None,  # a rank of a tensor-parallel group (model: its share, worker.parallel)
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = next(model.parameters()).device
        self.parallel = parallel
        kv_config = model_config if parallel is None else parallel.kv_config(model_config)  # the rank's KV heads
        self.kv_cache = allocate_kv_cache(kv_config, num_blocks, block_size,
                                          kv_cache_dtype(options.kv_cache_dtype, dtype), self.device)
        self.swap_space = HostSwapSpace(self.kv_cache, num_host_blocks)
        self.requests: dict[str, RunnerRequestState] = {}
        # constrained decoding's matchers; worker.build sets it from the model's vocabulary
        self.structured_output: StructuredOutput | None = None
        # --speculative draft's draft model (worker.build sets it with --draft-model); None: none
        self.drafter: DraftModel | None = None
        # prepare() (RPC thread) and run()'s bookkeeping (compute thread) may overlap across steps
        self._state_lock = threading.Lock()
        self.execution = resolve_execution(options, self.device, model_config)
        self.execution_path = build_execution_path(model, self.kv_cache, block_size, self.execution, self.device,
                                                   decode_group_bytes)
        if parallel is not None and parallel.leads:  # the other ranks build and run what rank 0 does
            parallel.channel.send("runner", num_blocks, num_host_blocks)
            self.swap_space = LeaderSwapSpace(self.swap_space, parallel.channel)
            self.execution_path = LeaderPath(self.execution_path, parallel.channel)

    def _check_block_ids(self, request_id: str, block_ids: list[int], step_id: int) -> None:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise PlanMismatchError(
                    f"step {step_id}: request {request_id!r} got block id {block_id}, outside 0..{self.num_blocks - 1}"
                )

    def _check_copies(self, plan: StepPlan) -> None:
        for device_block_id, host_block_id in [*plan.swap_out, *plan.swap_in]:
            if not (0 <= device_block_id < self.num_blocks and 0 <= host_block_id < self.swap_space.num_host_blocks):
                raise PlanMismatchError(
                    f"step {plan.step_id}: page copy between device block {device_block_id} and host block "
                    f"{host_block_id}, outside 0..{self.num_blocks - 1} / 0..{self.swap_space.num_host_blocks - 1}")

    def _apply_plan_state(self, plan: StepPlan) -> None:
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in plan.new_requests:
            self._check_block_ids(new.request_id, new.block_ids, plan.step_id)
            # a request resumed after preemption arrives in full again and replaces any old copy
            self.requests[new.request_id] = RunnerRequestState(
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_table=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                matcher=self._new_matcher(new),
                num_draft_computed=new.num_computed_tokens,  # cached or swapped-in pages hold the draft's K/V too
            )
        for cached in plan.cached_requests:
            state = self._state(cached.request_id, plan.step_id)  # counts include prepared steps
            if cached.num_computed_tokens != state.num_computed_tokens:
                raise PlanMismatchError(
                    f"step {plan.step_id}: request {cached.request_id!r} has num_computed_tokens="
                    f"{cached.num_computed_tokens} in the plan but {state.num_computed_tokens} in the worker"
                )
            self._check_block_ids(cached.request_id, cached.new_block_ids, plan.step_id)
            if cached.num_dropped_block_ids:  # pages only rejected drafts had written, given back
                if cached.num_dropped_block_ids > len(state.block_table):
                    raise PlanMismatchError(f"step {plan.step_id}: request {cached.request_id!r} drops "
                                            f"{cached.num_dropped_block_ids} pages of {len(state.block_table)}")
                del state.block_table[len(state.block_table) - cached.num_dropped_block_ids:]
                # a dropped page may have been another request's since: its guesses' K/V is gone
                del state.draft_guess_inputs[max(len(state.block_table) * self.block_size - state.num_draft_computed, 0):]
            state.block_table.extend(cached.new_block_ids)

    def _new_matcher(self, new: NewRequestData) -> llguidance.LLMatcher | None:
        """The request's grammar matcher, replayed over the output it arrives with (a recomputed
        request continues from the same state, so it ends with the same output)."""
        if new.sampling_params.constraint is None:
            return None
        if self.structured_output is None:
            raise PlanMismatchError(f"request {new.request_id!r} is constrained, but this runner has no grammar "
                                    f"vocabulary (built without worker.sampling.structured_output)")
        return self.structured_output.new_matcher(new.sampling_params, new.token_ids[new.num_prompt_tokens:])

    def _state(self, request_id: str, step_id: int) -> RunnerRequestState:
        state = self.requests.get(request_id)
        if state is None:
            raise PlanMismatchError(f"step {step_id}: unknown request id {request_id!r} (never sent as a new request, or already finished)")
        return state

    def _pack(self, plan: StepPlan) -> PreparedStep:
        """The scheduled tokens of every request, in plan order, as one flat batch (invariant 5)."""
        batch = StepBatch(plan.step_id)
        step = PreparedStep(plan.step_id, batch)
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            state = self._state(request_id, plan.step_id)
            if self.drafter is not None:
                step.draft_requests.append((request_id, state, plan.num_draft_tokens.get(request_id, 0)))
            if request_id in plan.spec_token_ids:
                self._pack_verify(plan, request_id, state, step)
                continue
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
            if num_tokens < 1 or end > state.num_planned_tokens:
                raise PlanMismatchError(
                    f"step {plan.step_id}: request {request_id!r} scheduled {num_tokens} tokens from "
                    f"{start}, but it has {state.num_planned_tokens} tokens"
                )
            batch.spans.append(RequestSpan(len(batch.input_ids), num_tokens, end, state.block_table))
            known = min(end, len(state.token_ids))
            for position in range(known, end):  # sampled by a step that has not run yet
                batch.placeholder_rows.append(len(batch.input_ids) + position - start)
                batch.placeholder_sources.append(state.pending_sources.get(position, (-1, -1)))
                step.placeholder_tokens.append((state, position))
            batch.input_ids.extend(state.token_ids[start:known])
            batch.input_ids.extend([PLACEHOLDER_TOKEN_ID] * (end - known))
            batch.positions.extend(range(start, end))
            self._pack_prompt_logprob_rows(request_id, state, start, end, len(batch.input_ids) - num_tokens, step)
            state.num_computed_tokens = end
            if end == state.num_planned_tokens:  # caught up: its last row predicts the next token
                step.sampling_ids.append(request_id)
                step.sampling_states.append(state)
                batch.sample_rows.append(len(batch.input_ids) - 1)
                state.pending_sources[end] = (plan.step_id, len(step.sampling_ids) - 1)
                state.num_pending_tokens += 1
        return step

    @staticmethod
    def _pack_verify(plan: StepPlan, request_id: str, state: RunnerRequestState, step: PreparedStep) -> None:
        """A decode with k drafts: one span of 1 + k rows (its last token, then the drafts), all reaching lm_head.
        Its computed count covers them all until run() knows how many were accepted."""
        drafts, num_tokens = plan.spec_token_ids[request_id], plan.num_scheduled_tokens[request_id]
        start = state.num_computed_tokens
        if (not drafts or num_tokens != 1 + len(drafts) or state.num_pending_tokens
                or len(state.token_ids) != start + 1):
            raise PlanMismatchError(f"step {plan.step_id}: request {request_id!r} verifies {len(drafts)} drafts in "
                                    f"{num_tokens} tokens from {start}, but it has {len(state.token_ids)} tokens")
        batch = step.batch
        first_row = len(batch.input_ids)
        batch.spans.append(RequestSpan(first_row, num_tokens, start + num_tokens, state.block_table))
        batch.input_ids.extend([state.token_ids[start], *drafts])
        batch.positions.extend(range(start, start + num_tokens))
        batch.verify_rows.extend(range(first_row, first_row + num_tokens))
        state.num_computed_tokens = start + num_tokens
        step.verify_ids.append(request_id)
        step.verify_states.append(state)
        step.verify_drafts.append(list(drafts))

    @staticmethod
    def _pack_prompt_logprob_rows(request_id: str, state: RunnerRequestState, start: int, end: int,
                                  first_row: int, step: PreparedStep) -> None:
        """Positions start..end-1 of a request that asks for prompt logprobs: each whose next token is a
        prompt token gets its logits computed (the prompt's last row predicts the first output: a sample row)."""
        num_top = state.sampling_params.prompt_logprobs
        last = min(end, state.num_prompt_tokens - 1)  # positions before it predict prompt tokens
        if num_top is None or last <= start:
            return
        step.batch.prompt_logprob_rows.extend(range(first_row, first_row + last - start))
        step.prompt_logprob_targets.extend(state.token_ids[start + 1:last + 1])
        step.prompt_logprob_top.extend([num_top] * (last - start))
        step.prompt_logprob_spans.append((request_id, start + 1, last - start))

    def execute(self, plan: StepPlan) -> StepResult:
        return self.run(self.prepare(plan))

    def prepare(self, plan: StepPlan) -> PreparedStep:
        """Applies the plan to the runner's request state and packs the batch; runs nothing.

        Steps must be prepared and run in step order; a step may be prepared while the one before it runs."""
        self._check_copies(plan)
        if plan.num_draft_tokens and self.drafter is None:
            raise PlanMismatchError(f"step {plan.step_id}: the plan asks for draft tokens (--speculative draft), but "
                                    f"this worker has no draft model (start it with --draft-model)")
        with self._state_lock:
            self._apply_plan_state(plan)
            if plan.is_empty:
                return PreparedStep(plan.step_id, swap_out=plan.swap_out, swap_in=plan.swap_in)
            step = self._pack(plan)
        step.swap_out, step.swap_in = plan.swap_out, plan.swap_in
        try:
            step.inputs = self.execution_path.prepare(step.batch)
        except ValueError as exc:  # a block table too short for its context
            raise PlanMismatchError(f"step {plan.step_id}: {exc}") from None
        return step

    def run(self, prepared: PreparedStep) -> StepResult:
        """Forward pass and sampling of a prepared step; call after the previous step's run()."""
        batch = prepared.batch
        # after the previous step's run(): the pages it wrote are final; before this one writes any
        self.swap_space.copy(prepared.swap_out, prepared.swap_in)
        if self.drafter is not None:  # the draft's K/V lives in the same page ids
            self.drafter.swap_space.copy(prepared.swap_out, prepared.swap_in)
        if batch is None:
            return StepResult(step_id=prepared.step_id)
        with self._state_lock:
            for row, (state, position) in zip(batch.placeholder_rows, prepared.placeholder_tokens):
                if position >= len(state.token_ids):
                    raise PlanMismatchError(f"step {prepared.step_id}: the token at position {position} "
                                            f"was never sampled (steps run out of order?)")
                batch.input_ids[row] = state.token_ids[position]
        with torch.inference_mode():
            started = time.perf_counter_ns()
            logits = self.execution_path.forward(batch, prepared.inputs)  # [R + Q + S, vocab] float32
            forward_ns = time.perf_counter_ns() - started
            num_sample_rows = len(batch.sample_rows)
            num_verify_start = num_sample_rows + len(batch.prompt_logprob_rows)  # verify rows come last
            prompt_entries = prompt_logprobs(logits[num_sample_rows:num_verify_start],
                                             prepared.prompt_logprob_targets, prepared.prompt_logprob_top)
            verdicts = self._verify(prepared, logits[num_verify_start:])
            logits = logits[:num_sample_rows]
            # token_ids hold exactly the tokens sampled before this step: what penalties and seeds read
            rows = [SamplingRow(state.sampling_params, state.token_ids, state.num_prompt_tokens)
                    for state in prepared.sampling_states]
            matchers = [state.matcher for state in prepared.sampling_states]
            token_bitmask = (self.structured_output.bitmask(matchers, logits.device)
                             if any(matcher is not None for matcher in matchers) else None)
            token_ids, logprobs = self.execution_path.sample(batch, logits, rows, token_bitmask)
        result = StepResult(step_id=prepared.step_id, forward_ns=forward_ns)
        with self._state_lock:
            for state, token_id in zip(prepared.sampling_states, token_ids):
                state.pending_sources.pop(len(state.token_ids), None)
                state.token_ids.append(token_id)
                state.num_pending_tokens -= 1
                if state.matcher is not None:
                    state.matcher.consume_token(token_id)
        for request_id, state, token_id, token_logprobs in zip(prepared.sampling_ids, prepared.sampling_states,
                                                                token_ids, logprobs):
            result.sampled_token_ids[request_id] = token_id
            if state.sampling_params.logprobs is not None and token_logprobs is not None:
                result.logprobs[request_id] = token_logprobs
        self._apply_verdicts(prepared, verdicts, result)
        offset = 0
        for request_id, first_position, count in prepared.prompt_logprob_spans:
            result.prompt_logprobs[request_id] = PromptLogprobs(first_position, prompt_entries[offset:offset + count])
            offset += count
        if self.drafter is not None:
            self._draft(prepared, result)
        return result

    def _draft(self, prepared: PreparedStep, result: StepResult) -> None:
        """The draft model catches up on the step's tokens and guesses the next ones where the plan asked
        (worker.draft_model draws the rows); the guesses go into result.draft_token_ids."""
        works: list[tuple[str, RunnerRequestState, DraftWork]] = []
        with self._state_lock:
            for request_id, state, num_wanted in prepared.draft_requests:
                num_tokens = len(state.token_ids)
                caught_up = num_tokens == state.num_computed_tokens + 1 and not state.num_pending_tokens
                num_guesses = min(num_wanted, self.drafter.capacity(state.block_table, num_tokens)) if caught_up else 0
                end = num_tokens if num_guesses else min(state.num_computed_tokens, num_tokens)
                start = first_to_compute(state.token_ids, state.num_draft_computed, end - (num_guesses > 0),
                                         state.draft_guess_inputs)
                works.append((request_id, state, DraftWork(state.token_ids, start, end, list(state.block_table),
                                                           num_guesses)))
                state.num_draft_computed = max(state.num_draft_computed, end)
        self.drafter.run([work for _, _, work in works])
        for request_id, state, work in works:
            state.draft_guess_inputs = work.guesses[:-1]  # d_1 .. d_{n-1} went in at end .. end + n - 2
            if work.guesses:
                result.draft_token_ids[request_id] = work.guesses

    def _verify(self, prepared: PreparedStep, logits: torch.Tensor) -> list[Verdict]:
        """The verdict on each verifying request's drafts (logits: [S, vocab], its 1 + k rows in a block each):
        (accepted drafts, the token after them, raw logprobs of each of those tokens where it asks for them)."""
        if not prepared.verify_ids:
            return []
        rows = [SamplingRow(state.sampling_params, state.token_ids, state.num_prompt_tokens)
                for state in prepared.verify_states]
        masks = [None if state.matcher is None else self.structured_output.draft_bitmask(state.matcher, drafts, logits.device)
                 for state, drafts in zip(prepared.verify_states, prepared.verify_drafts)]
        # a seeded request's tokens are those its path's sampler draws one step at a time (worker.sampling.speculative)
        verdicts = verify(logits, rows, prepared.verify_drafts, masks=masks,
                          draw=lambda block, block_rows, bitmask: self.execution_path.sample(
                              prepared.batch, block, block_rows, bitmask)[0])
        blocks = torch.split(logits, [1 + len(drafts) for drafts in prepared.verify_drafts])
        # the raw distribution of the row before each emitted token, as sample() reports them
        return [(accepted, token_id, None if row.params.logprobs is None else prompt_logprobs(
                    block[:len(accepted) + 1], [*accepted, token_id], [row.params.logprobs] * (len(accepted) + 1)))
                for row, block, (accepted, token_id) in zip(rows, blocks, verdicts)]

    def _apply_verdicts(self, prepared: PreparedStep, verdicts: list[Verdict],
                        result: StepResult) -> None:
        """Accepted drafts and the token after them join each request's tokens; rejected drafts' slots are no
        longer computed (their K/V stays in the pages, unread, until a later step overwrites it)."""
        with self._state_lock:
            for request_id, state, drafts, (accepted, token_id, logprobs) in zip(
                    prepared.verify_ids, prepared.verify_states, prepared.verify_drafts, verdicts):
                state.num_computed_tokens -= len(drafts) - len(accepted)
                state.token_ids.extend([*accepted, token_id])
                if state.matcher is not None:
                    state.matcher.consume_tokens([*accepted, token_id])
                result.sampled_token_ids[request_id] = token_id
                if accepted:
                    result.accepted_token_ids[request_id] = accepted
                if logprobs is not None:
                    result.logprobs[request_id] = logprobs[-1]
                    if accepted:
                        result.accepted_logprobs[request_id] = logprobs[:-1]

    def warm_up(self) -> None:
        """One tiny forward pass through both attention paths (a 2-token prefill and a decode row), then
        the path's own warm-up (the Triton path captures its decode graphs there).

        Writes garbage into block 0, so call it before serving (the worker reports ready after it).
        """
        batch = StepBatch(-1, input_ids=[0, 0, 0], positions=[0, 1, 2], sample_rows=[1, 2],
                          spans=[RequestSpan(0, 2, 2, [0, 0]), RequestSpan(2, 1, 3, [0, 0, 0])])
        with torch.inference_mode():
            self.execution_path.forward(batch, self.execution_path.prepare(batch))
            self.execution_path.warm_up()
        if self.drafter is not None:
            self.drafter.warm_up()
        if self.structured_output is not None:
            self.structured_output.warm_up()
