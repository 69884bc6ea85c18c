"""Executes StepPlans: the worker's side of scheduler.executor.Executor.

The runner keeps its own copy of each request's tokens (sent in full once, then extended by the
tokens it samples) and block table (extended by the plan's diffs). Each step packs the scheduled
tokens of all requests into one flat batch, runs the model once, and samples one token for every
request whose computed count reaches its token count (mid-prefill chunks sample nothing).

A step is prepare()d (plan state applied, batch packed, on the Triton backend its host metadata built:
plain Python, no torch op, so the RPC thread never starts an OpenMP team of its own) and then run().
With the scheduler's async scheduling, the worker service prepares step N+1 on its RPC thread while
the compute thread runs step N: a decode row whose input is the token step N samples is packed as a
placeholder and filled in by run(), which comes after step N's run() on the same thread.

On CUDA with stream overlap, prepare() also stages the step's integer inputs (pinned buffer, H2D copy on
the copy stream: worker.step_staging), so that copy overlaps step N's compute; run() then writes the
placeholder rows on the device from step N's sampled ids, which stay on the device (an index_copy on the
compute stream, indices staged with the inputs). Elsewhere the placeholders are filled on the host and
the inputs go up in run().
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from core.step import PLACEHOLDER_TOKEN_ID, StepPlan, StepResult
from core.sampling import SamplingParams
from worker.attention import DECODE_GROUP_BYTES, GatherWorkspace, RequestSpan, build_attention_metadata
from worker.backends import ExecutionOptions, resolve_execution
from worker.config import ModelConfig
from worker.kv_cache import allocate_kv_cache
from worker.model import LlamaModel
from worker.sampler import SamplingRow, sample


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

    @property
    def num_planned_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens


@dataclass(slots=True)
class _PackedStep:
    input_ids: list[int] = field(default_factory=list)  # [T]
    positions: list[int] = field(default_factory=list)  # [T]
    spans: list[RequestSpan] = field(default_factory=list)  # one per scheduled request, batch order
    sampling_ids: list[str] = field(default_factory=list)  # requests that sample this step
    sampling_states: list[RunnerRequestState] = field(default_factory=list)  # theirs, held past a drop
    sample_rows: list[int] = field(default_factory=list)  # their last row in the batch
    # (row, request, position): input tokens that an earlier step samples, known once it has run
    placeholder_rows: list[tuple[int, RunnerRequestState, int]] = field(default_factory=list)
    placeholder_sources: list[tuple[int, int]] = field(default_factory=list)  # (step id, sample index), per row


@dataclass(slots=True)
class PreparedStep:
    step_id: int
    packed: _PackedStep | None = None  # None: an empty plan
    metadata: object = None  # HostMetadata (Triton backend); None: the torch backend builds it in run()
    staged: object = None  # StagedStep: inputs already on their way up (CUDA, stream overlap); else None


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        decode_group_bytes: int = DECODE_GROUP_BYTES,  # K+V gathered per decode group (see worker.attention)
        options: ExecutionOptions = ExecutionOptions(),  # kernel backend, CUDA graphs, stream overlap
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = next(model.parameters()).device
        self.kv_cache = allocate_kv_cache(model_config, num_blocks, block_size, dtype, self.device)
        self.requests: dict[str, RunnerRequestState] = {}
        # prepare() (RPC thread) and run()'s bookkeeping (compute thread) may overlap across steps
        self._state_lock = threading.Lock()
        block_numel = block_size * model_config.num_kv_heads * model_config.head_dim
        self.gather_workspace = GatherWorkspace(block_numel, dtype, self.device, decode_group_bytes)
        self.execution = resolve_execution(options, self.device)
        if self.execution.packed_linears:
            from worker.cpu_linear import pack_linears

            pack_linears(model)  # in place: the model's linears now read oneDNN-reordered weights
        # the Triton path (and everything CUDA-only) lives in its own object; None on the torch backend
        self.kernel_path = None
        self._device_tokens: tuple[int, torch.Tensor | None] = (-1, None)  # (step id, its sampled ids [R] on the device)
        if self.execution.kernel_backend == "triton":
            from worker.kernel_path import KernelPath

            self.kernel_path = KernelPath(model, self.kv_cache, block_size, self.execution, self.device)

    def _check_block_ids(self, request_id: str, block_ids: list[int], step_id: int) -> None:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise PlanMismatchError(
                    f"step {step_id}: request {request_id!r} got block id {block_id}, outside 0..{self.num_blocks - 1}"
                )

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
            )
        for cached in plan.cached_requests:
            state = self._state(cached.request_id, plan.step_id)  # counts include prepared steps
            if cached.num_computed_tokens != state.num_computed_tokens:
                raise PlanMismatchError(
                    f"step {plan.step_id}: request {cached.request_id!r} has num_computed_tokens="
                    f"{cached.num_computed_tokens} in the plan but {state.num_computed_tokens} in the worker"
                )
            self._check_block_ids(cached.request_id, cached.new_block_ids, plan.step_id)
            state.block_table.extend(cached.new_block_ids)

    def _state(self, request_id: str, step_id: int) -> RunnerRequestState:
        state = self.requests.get(request_id)
        if state is None:
            raise PlanMismatchError(f"step {step_id}: unknown request id {request_id!r} (never sent as a new request, or already finished)")
        return state

    def _pack(self, plan: StepPlan) -> _PackedStep:
        """The scheduled tokens of every request, in plan order, as one flat batch (invariant 5)."""
        packed = _PackedStep()
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            state = self._state(request_id, plan.step_id)
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
            if num_tokens < 1 or end > state.num_planned_tokens:
                raise PlanMismatchError(
                    f"step {plan.step_id}: request {request_id!r} scheduled {num_tokens} tokens from "
                    f"{start}, but it has {state.num_planned_tokens} tokens"
                )
            packed.spans.append(RequestSpan(len(packed.input_ids), num_tokens, end, state.block_table))
            known = min(end, len(state.token_ids))
            for position in range(known, end):  # sampled by a step that has not run yet
                packed.placeholder_rows.append((len(packed.input_ids) + position - start, state, position))
                packed.placeholder_sources.append(state.pending_sources.get(position, (-1, -1)))
            packed.input_ids.extend(state.token_ids[start:known])
            packed.input_ids.extend([PLACEHOLDER_TOKEN_ID] * (end - known))
            packed.positions.extend(range(start, end))
            state.num_computed_tokens = end
            if end == state.num_planned_tokens:  # caught up: its last row predicts the next token
                packed.sampling_ids.append(request_id)
                packed.sampling_states.append(state)
                packed.sample_rows.append(len(packed.input_ids) - 1)
                state.pending_sources[end] = (plan.step_id, len(packed.sampling_ids) - 1)
                state.num_pending_tokens += 1
        return packed

    def execute(self, plan: StepPlan) -> StepResult:
        return self.run(self.prepare(plan))

    def prepare(self, plan: StepPlan) -> PreparedStep:
        """Applies the plan to the runner's request state and packs the batch; runs nothing.

        Steps must be prepared and run in step order; a step may be prepared while the one before it runs."""
        with self._state_lock:
            self._apply_plan_state(plan)
            if plan.is_empty:
                return PreparedStep(plan.step_id)
            packed = self._pack(plan)
        if self.kernel_path is None:
            return PreparedStep(plan.step_id, packed)
        try:
            metadata = self.kernel_path.host_metadata(packed.spans)
        except ValueError as exc:
            raise PlanMismatchError(f"step {plan.step_id}: {exc}") from None
        staged = None
        if self.kernel_path.stager is not None:  # CUDA: the H2D copy starts now, while the step before runs
            staged = self.kernel_path.stager.stage(packed.input_ids, packed.positions, metadata,
                                                   [row for row, _, _ in packed.placeholder_rows],
                                                   [index for _, index in packed.placeholder_sources])
        return PreparedStep(plan.step_id, packed, metadata, staged)

    def run(self, prepared: PreparedStep) -> StepResult:
        """Forward pass and sampling of a prepared step; call after the previous step's run()."""
        packed, metadata = prepared.packed, prepared.metadata
        if packed is None:
            return StepResult(step_id=prepared.step_id)
        with self._state_lock:
            for row, state, position in packed.placeholder_rows:
                if position >= len(state.token_ids):
                    raise PlanMismatchError(f"step {prepared.step_id}: the token at position {position} "
                                            f"was never sampled (steps run out of order?)")
                packed.input_ids[row] = state.token_ids[position]
        if metadata is None:  # torch backend: built here, on the compute thread (it makes tensors)
            try:
                metadata = build_attention_metadata(packed.spans, self.block_size, self.device, self.gather_workspace)
            except ValueError as exc:
                raise PlanMismatchError(f"step {prepared.step_id}: {exc}") from None
        with torch.inference_mode():
            started = time.perf_counter_ns()
            if prepared.staged is not None:
                logits = self.kernel_path.staged_logits(prepared.staged, packed.sample_rows,
                                                        self._placeholder_tokens(packed))
            elif self.kernel_path is not None:
                logits = self.kernel_path.logits(packed.input_ids, packed.positions, metadata, packed.sample_rows)
            else:
                hidden = self.model(
                    torch.tensor(packed.input_ids, dtype=torch.long, device=self.device),
                    torch.tensor(packed.positions, dtype=torch.long, device=self.device),
                    self.kv_cache,
                    metadata,
                )  # [T, hidden]
                logits = self.model.compute_logits(hidden[packed.sample_rows])  # [R, vocab] float32
            forward_ns = time.perf_counter_ns() - started
            # token_ids hold exactly the tokens sampled before this step: what penalties and seeds read
            rows = [self._sampling_row(state) for state in packed.sampling_states]
            if self.kernel_path is not None:
                token_ids, logprobs = self.kernel_path.sample(logits, rows)
                self._device_tokens = (prepared.step_id, self.kernel_path.last_device_tokens)
            else:
                token_ids, logprobs = sample(logits, rows) if rows else ([], [])
        result = StepResult(step_id=prepared.step_id, forward_ns=forward_ns)
        with self._state_lock:
            for state, token_id in zip(packed.sampling_states, token_ids):
                state.pending_sources.pop(len(state.token_ids), None)
                state.token_ids.append(token_id)
                state.num_pending_tokens -= 1
        for request_id, state, token_id, token_logprobs in zip(packed.sampling_ids, packed.sampling_states,
                                                                token_ids, logprobs):
            result.sampled_token_ids[request_id] = token_id
            if state.sampling_params.logprobs is not None and token_logprobs is not None:
                result.logprobs[request_id] = token_logprobs
        return result

    def _placeholder_tokens(self, packed: _PackedStep):
        """What a staged step's placeholder rows get: the last step's sampled ids still on the device when
        every placeholder is one of them (async scheduling's decode rows), else the host-filled ids."""
        if not packed.placeholder_rows:
            return None
        step_id, tokens = self._device_tokens
        if tokens is not None and all(source == step_id for source, _ in packed.placeholder_sources):
            return tokens
        return [packed.input_ids[row] for row, _, _ in packed.placeholder_rows]

    @staticmethod
    def _sampling_row(state: RunnerRequestState) -> SamplingRow:
        return SamplingRow(params=state.sampling_params, token_ids=state.token_ids, num_prompt_tokens=state.num_prompt_tokens)

    def warm_up(self) -> None:
        """One tiny forward pass through both attention paths (a 2-token prefill and a decode row);
        on the Triton backend with CUDA graphs, also captures the decode graphs.

        Writes garbage into block 0, so call it before serving (the worker reports ready after it).
        """
        spans = [RequestSpan(0, 2, 2, [0, 0]), RequestSpan(2, 1, 3, [0, 0, 0])]
        with torch.inference_mode():
            if self.kernel_path is not None:
                self.kernel_path.logits([0, 0, 0], [0, 1, 2], self.kernel_path.host_metadata(spans), [1, 2])
                self.kernel_path.warm_up()
                return
            attn_metadata = build_attention_metadata(spans, self.block_size, self.device, self.gather_workspace)
            ids = torch.zeros(3, dtype=torch.long, device=self.device)
            positions = torch.tensor([0, 1, 2], device=self.device)
            hidden = self.model(ids, positions, self.kv_cache, attn_metadata)
            self.model.compute_logits(hidden[[1, 2]])
