"""The one place that converts domain objects to and from the internal protobuf messages.

Servicers and clients on the scheduler <-> worker and gateway -> scheduler hops call these and
nothing else touches the generated types, so protobuf stays at the edges.

Step plans and results cross the wire every step, so their converters are written out field by
field (no reflection over descriptors or dataclass fields), and what each running request adds to a
step goes in packed columns rather than a message per request (to peers that take them: StepPlan's
batch and cached columns, StepResult's sampled columns, StepDeltas' columns): a 32-request decode
plan and its result encode and decode in ~70 us on one CPU core, ~360 us as a message per request
(tests/protos/test_codec.py prints the figures).
"""
from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from core.outputs import FinishReason, RequestOutput, RequestTimings
from core.requests import GenerationRequest
from core.sampling import ConstraintKind, OutputConstraint, SamplingParams
from core.step import CachedRequestData, NewRequestData, PromptLogprobs, StepPlan, StepResult, TokenLogprobs
from protos.tokenmill.v1 import common_pb2, sampling_pb2, scheduler_pb2, worker_pb2

_DEFAULTS = SamplingParams()

# ---- sampling params ------------------------------------------------------------------------


def sampling_params_to_proto(params: SamplingParams) -> sampling_pb2.SamplingParams:
    # Every field is written, so the receiver never falls back to a default it might not share.
    # None (seed, logprobs) leaves the optional field unset, which is how "none" differs from 0.
    return sampling_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=params.seed,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        logprobs=params.logprobs,
        constraint=None if params.constraint is None else constraint_to_proto(params.constraint),
        logit_bias=[sampling_pb2.TokenBias(token_id=token_id, bias=bias) for token_id, bias in params.logit_bias],
        prompt_logprobs=params.prompt_logprobs,
        no_speculation=not params.speculative,
    )


def constraint_to_proto(constraint: OutputConstraint) -> sampling_pb2.OutputConstraint:
    kind = constraint.kind
    if kind is ConstraintKind.CHOICE:
        return sampling_pb2.OutputConstraint(choice=sampling_pb2.ChoiceList(choices=constraint.choices))
    if kind is ConstraintKind.JSON_OBJECT:
        return sampling_pb2.OutputConstraint(json_object=True)
    return sampling_pb2.OutputConstraint(**{kind.value: constraint.value})


def constraint_from_proto(msg: sampling_pb2.OutputConstraint) -> OutputConstraint | None:
    """None when no kind is set."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "choice":
        return OutputConstraint(ConstraintKind.CHOICE, choices=tuple(msg.choice.choices))
    if kind == "json_object":
        return OutputConstraint(ConstraintKind.JSON_OBJECT)
    return OutputConstraint(ConstraintKind(kind), getattr(msg, kind))


def sampling_params_from_proto(msg: sampling_pb2.SamplingParams) -> SamplingParams:
    # An unset field takes the domain default (not proto3's zero: an unset temperature is 1, not greedy).
    has = msg.HasField
    return SamplingParams(
        max_tokens=msg.max_tokens if has("max_tokens") else _DEFAULTS.max_tokens,
        temperature=msg.temperature if has("temperature") else _DEFAULTS.temperature,
        top_k=msg.top_k if has("top_k") else _DEFAULTS.top_k,
        top_p=msg.top_p if has("top_p") else _DEFAULTS.top_p,
        min_p=msg.min_p if has("min_p") else _DEFAULTS.min_p,
        repetition_penalty=(
            msg.repetition_penalty if has("repetition_penalty") else _DEFAULTS.repetition_penalty
        ),
        presence_penalty=msg.presence_penalty if has("presence_penalty") else _DEFAULTS.presence_penalty,
        frequency_penalty=(
            msg.frequency_penalty if has("frequency_penalty") else _DEFAULTS.frequency_penalty
        ),
        seed=msg.seed if has("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if has("logprobs") else None,
        constraint=constraint_from_proto(msg.constraint) if has("constraint") else None,
        logit_bias=tuple((entry.token_id, entry.bias) for entry in msg.logit_bias),
        prompt_logprobs=msg.prompt_logprobs if has("prompt_logprobs") else None,
        speculative=not msg.no_speculation,
    )


# ---- logprobs and finish reasons ------------------------------------------------------------


def token_logprobs_to_proto(logprobs: TokenLogprobs) -> common_pb2.TokenLogprobs:
    return common_pb2.TokenLogprobs(
        logprob=logprobs.logprob,
        top_token_ids=[token_id for token_id, _ in logprobs.top],
        top_logprobs=[logprob for _, logprob in logprobs.top],
    )


def token_logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(logprob=msg.logprob, top=list(zip(msg.top_token_ids, msg.top_logprobs)))


# core.outputs.FinishReason <-> the proto enum; None is "not finished".
_FINISH_REASON_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FINISH_REASON_FROM_PROTO = {code: reason for reason, code in _FINISH_REASON_TO_PROTO.items()}


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    try:
        return _FINISH_REASON_TO_PROTO[reason]
    except KeyError:
        raise ValueError(f"finish_reason={reason!r} is not a FinishReason or None") from None


def finish_reason_from_proto(code: int) -> FinishReason | None:
    try:
        return _FINISH_REASON_FROM_PROTO[code]
    except KeyError:
        raise ValueError(f"finish_reason={code} is not a known FinishReason value") from None


# ---- gateway -> scheduler -------------------------------------------------------------------


def submit_request_to_proto(
    request: GenerationRequest, deadline_unix_s: float | None = None, *, resumable: bool = False,
    owner: str | None = None,
) -> scheduler_pb2.SubmitRequest:
    msg = scheduler_pb2.SubmitRequest(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=sampling_params_to_proto(request.sampling_params),
        eos_token_id=request.eos_token_id,
        priority=request.priority,
        resumable=resumable,
        owner=owner or "",
        target_itl_ms=request.target_itl_ms,
        target_ttft_ms=request.target_ttft_ms,
    )
    if deadline_unix_s is not None:
        msg.deadline.FromNanoseconds(round(deadline_unix_s * 1e9))
    return msg


def generation_request_from_submit_proto(msg: scheduler_pb2.SubmitRequest) -> GenerationRequest:
    return GenerationRequest(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        sampling_params=sampling_params_from_proto(msg.sampling_params),
        eos_token_id=msg.eos_token_id if msg.HasField("eos_token_id") else None,
        priority=msg.priority,
        target_itl_ms=msg.target_itl_ms if msg.HasField("target_itl_ms") else None,
        target_ttft_ms=msg.target_ttft_ms if msg.HasField("target_ttft_ms") else None,
    )


def deadline_from_submit_proto(msg: scheduler_pb2.SubmitRequest) -> float | None:
    """The request's deadline in Unix seconds (wall clock), or None when it has none."""
    return timestamp_to_unix_s(msg.deadline) if msg.HasField("deadline") else None


def timestamp_to_unix_s(timestamp: Timestamp) -> float:
    return timestamp.seconds + timestamp.nanos * 1e-9


# ---- scheduler <-> worker (hot path) --------------------------------------------------------


def step_plan_to_proto(plan: StepPlan, columns: bool = False) -> worker_pb2.StepPlan:
    """columns (a worker that reports columnar_steps): the batch and the cached requests as StepPlan's
    columns, a ScheduledTokens entry only for a request with speculative fields. Each is a message per
    running request and step otherwise, 1-2 us apiece to encode and again to decode."""
    msg = worker_pb2.StepPlan(step_id=plan.step_id, finished_request_ids=plan.finished_request_ids)
    # .add() on the parent's repeated field is ~1.7x faster than building child messages and
    # passing a list, which copies them.
    new_requests = msg.new_requests
    for new in plan.new_requests:
        new_requests.add(
            request_id=new.request_id,
            token_ids=new.token_ids,
            num_prompt_tokens=new.num_prompt_tokens,
            sampling_params=sampling_params_to_proto(new.sampling_params),
            block_ids=new.block_ids,
            num_computed_tokens=new.num_computed_tokens,
            trace_context=new.trace_context,
        )
    if columns:
        _cached_requests_as_columns(plan.cached_requests, msg)
    cached_requests = msg.cached_requests
    for cached in () if columns else plan.cached_requests:
        cached_requests.add(
            request_id=cached.request_id,
            new_block_ids=cached.new_block_ids,
            num_computed_tokens=cached.num_computed_tokens,
            num_dropped_block_ids=cached.num_dropped_block_ids,
        )
    # dict insertion order is the packed batch order; a repeated field keeps it (a proto map would not)
    scheduled = msg.num_scheduled_tokens
    drafts, num_draft_tokens = plan.spec_token_ids, plan.num_draft_tokens
    if columns:
        batch = plan.num_scheduled_tokens
        msg.batch_request_ids.extend(batch)
        msg.batch_num_tokens.extend(batch.values())
        for request_id in drafts.keys() | num_draft_tokens.keys():  # the worker reads them by id
            scheduled.add(request_id=request_id, num_tokens=batch[request_id], spec_token_ids=drafts.get(request_id, ()),
                          num_draft_tokens=num_draft_tokens.get(request_id, 0))
    else:
        for request_id, num_tokens in plan.num_scheduled_tokens.items():
            scheduled.add(request_id=request_id, num_tokens=num_tokens, spec_token_ids=drafts.get(request_id, ()),
                          num_draft_tokens=num_draft_tokens.get(request_id, 0))
    for device_block_id, host_block_id in plan.swap_out:
        msg.swap_out.add(device_block_id=device_block_id, host_block_id=host_block_id)
    for device_block_id, host_block_id in plan.swap_in:
        msg.swap_in.add(device_block_id=device_block_id, host_block_id=host_block_id)
    return msg


def _cached_requests_as_columns(cached_requests: list[CachedRequestData], msg: worker_pb2.StepPlan) -> None:
    ids, computed, dropped, num_new, new_ids = [], [], [], [], []
    for cached in cached_requests:
        ids.append(cached.request_id)
        computed.append(cached.num_computed_tokens)
        dropped.append(cached.num_dropped_block_ids)
        num_new.append(len(cached.new_block_ids))
        new_ids += cached.new_block_ids
    msg.cached_request_ids.extend(ids)
    msg.cached_num_computed_tokens.extend(computed)
    msg.cached_num_dropped_block_ids.extend(dropped)
    msg.cached_num_new_block_ids.extend(num_new)
    msg.cached_new_block_ids.extend(new_ids)


def _cached_requests_from_columns(msg: worker_pb2.StepPlan) -> list[CachedRequestData]:
    new_ids, end, cached = list(msg.cached_new_block_ids), 0, []
    for request_id, computed, dropped, count in zip(msg.cached_request_ids, msg.cached_num_computed_tokens,
                                                    msg.cached_num_dropped_block_ids, msg.cached_num_new_block_ids):
        start, end = end, end + count
        cached.append(CachedRequestData(request_id, new_ids[start:end], computed, dropped))
    if end != len(new_ids):
        raise ValueError(f"StepPlan: the cached columns count {end} new page ids, the message has {len(new_ids)}")
    return cached


def step_plan_from_proto(msg: worker_pb2.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=msg.step_id,
        new_requests=[
            NewRequestData(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=sampling_params_from_proto(new.sampling_params),
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                trace_context=new.trace_context,
            )
            for new in msg.new_requests
        ],
        cached_requests=_cached_requests_from_columns(msg) if msg.cached_request_ids else [
            CachedRequestData(
                request_id=cached.request_id,
                new_block_ids=list(cached.new_block_ids),
                num_computed_tokens=cached.num_computed_tokens,
                num_dropped_block_ids=cached.num_dropped_block_ids,
            )
            for cached in msg.cached_requests
        ],
        num_scheduled_tokens=dict(zip(msg.batch_request_ids, msg.batch_num_tokens)) if msg.batch_request_ids
        else {entry.request_id: entry.num_tokens for entry in msg.num_scheduled_tokens},
        spec_token_ids={entry.request_id: list(entry.spec_token_ids) for entry in msg.num_scheduled_tokens
                        if entry.spec_token_ids},
        num_draft_tokens={entry.request_id: entry.num_draft_tokens for entry in msg.num_scheduled_tokens
                          if entry.num_draft_tokens},
        finished_request_ids=list(msg.finished_request_ids),
        swap_out=[(copy.device_block_id, copy.host_block_id) for copy in msg.swap_out],
        swap_in=[(copy.device_block_id, copy.host_block_id) for copy in msg.swap_in],
    )


def step_result_to_proto(result: StepResult, columns: bool = False) -> worker_pb2.StepResult:
    """columns: every sampled token in StepResult.sampled_request_ids / sampled_token_ids (the answer to a plan
    sent as columns), a SampledToken entry only for a request with more than its token."""
    logprobs = result.logprobs
    orphans = logprobs.keys() - result.sampled_token_ids.keys()
    if orphans:
        raise ValueError(
            f"step {result.step_id}: logprobs for requests that sampled no token: {sorted(orphans)}"
        )
    msg = worker_pb2.StepResult(step_id=result.step_id, forward_ns=result.forward_ns)
    sampled_tokens = msg.sampled_tokens
    accepted = result.accepted_token_ids
    sampled = result.sampled_token_ids
    if columns:
        msg.sampled_request_ids.extend(sampled)
        msg.sampled_token_ids.extend(sampled.values())
        more = logprobs.keys() | accepted.keys() | result.accepted_logprobs.keys() | result.draft_token_ids.keys()
        sampled = {request_id: token_id for request_id, token_id in sampled.items() if request_id in more}
    for request_id, token_id in sampled.items():
        entry = sampled_tokens.add(request_id=request_id, token_id=token_id,
                                   accepted_token_ids=accepted.get(request_id, ()),
                                   accepted_logprobs=[token_logprobs_to_proto(entry) for entry in
                                                      result.accepted_logprobs.get(request_id, ())],
                                   draft_token_ids=result.draft_token_ids.get(request_id, ()))
        token_logprobs = logprobs.get(request_id)
        if token_logprobs is not None:
            # SetInParent: a logprob of exactly 0.0 with no top list must still read as "present"
            entry.logprobs.SetInParent()
            entry.logprobs.logprob = token_logprobs.logprob
            entry.logprobs.top_token_ids.extend(top_id for top_id, _ in token_logprobs.top)
            entry.logprobs.top_logprobs.extend(top_logprob for _, top_logprob in token_logprobs.top)
    for request_id, chunk in result.prompt_logprobs.items():
        msg.prompt_logprobs.add(request_id=request_id, first_position=chunk.first_position,
                                entries=[token_logprobs_to_proto(entry) for entry in chunk.entries])
    return msg


def step_result_from_proto(msg: worker_pb2.StepResult) -> StepResult:
    sampled_token_ids: dict[str, int] = {}
    accepted_token_ids: dict[str, list[int]] = {}
    accepted_logprobs: dict[str, list[TokenLogprobs]] = {}
    logprobs: dict[str, TokenLogprobs] = {}
    draft_token_ids: dict[str, list[int]] = {}
    if msg.sampled_request_ids:  # columns: the entries only add to them
        sampled_token_ids = dict(zip(msg.sampled_request_ids, msg.sampled_token_ids))
    for entry in msg.sampled_tokens:
        sampled_token_ids[entry.request_id] = entry.token_id
        if entry.draft_token_ids:
            draft_token_ids[entry.request_id] = list(entry.draft_token_ids)
        if entry.accepted_token_ids:
            accepted_token_ids[entry.request_id] = list(entry.accepted_token_ids)
        if entry.accepted_logprobs:
            accepted_logprobs[entry.request_id] = [token_logprobs_from_proto(item) for item in entry.accepted_logprobs]
        if entry.HasField("logprobs"):
            logprobs[entry.request_id] = token_logprobs_from_proto(entry.logprobs)
    return StepResult(
        step_id=msg.step_id,
        sampled_token_ids=sampled_token_ids,
        accepted_token_ids=accepted_token_ids,
        accepted_logprobs=accepted_logprobs,
        logprobs=logprobs,
        forward_ns=msg.forward_ns,
        prompt_logprobs={chunk.request_id: PromptLogprobs(chunk.first_position,
                                                          [token_logprobs_from_proto(entry) for entry in chunk.entries])
                         for chunk in msg.prompt_logprobs},
        draft_token_ids=draft_token_ids,
    )


# ---- scheduler -> gateway token deltas ------------------------------------------------------


def timings_to_proto(timings: RequestTimings) -> common_pb2.Timings:
    return common_pb2.Timings(queue_ns=timings.queue_ns, time_to_first_token_ns=timings.time_to_first_token_ns,
                              decode_ns=timings.decode_ns, e2e_ns=timings.e2e_ns,
                              first_token_forward_ns=timings.first_token_forward_ns)


def timings_from_proto(msg: common_pb2.Timings) -> RequestTimings:
    return RequestTimings(queue_ns=msg.queue_ns, time_to_first_token_ns=msg.time_to_first_token_ns,
                          decode_ns=msg.decode_ns, e2e_ns=msg.e2e_ns,
                          first_token_forward_ns=msg.first_token_forward_ns)


def request_output_to_proto(output: RequestOutput) -> scheduler_pb2.SubmitResponse:
    """output.error is not sent: a failed request ends its Submit call with the error's status instead."""
    timings = timings_to_proto(output.timings) if output.timings is not None else None
    msg = scheduler_pb2.SubmitResponse(
        request_id=output.request_id, new_token_ids=output.new_token_ids, finished=output.finished,
        finish_reason=finish_reason_to_proto(output.finish_reason), num_prompt_tokens=output.num_prompt_tokens,
        num_output_tokens=output.num_output_tokens, num_cached_tokens=output.num_cached_tokens,
        num_preemptions=output.num_preemptions, timings=timings)
    for token_logprobs in output.logprobs:
        msg.logprobs.append(token_logprobs_to_proto(token_logprobs))
    for token_logprobs in output.prompt_logprobs or ():
        msg.prompt_logprobs.append(token_logprobs_to_proto(token_logprobs))
    return msg


def step_deltas_to_proto(outputs: list[RequestOutput], columns: bool = False) -> scheduler_pb2.StepDeltas:
    """One StepDeltas message; columns (a gateway that asked for them): the outputs with nothing but counts
    and token ids as StepDeltas' columns, the others as SubmitResponse entries."""
    msg = scheduler_pb2.StepDeltas()
    if not columns:
        msg.deltas.extend(map(request_output_to_proto, outputs))
        return msg
    request_ids, num_new_tokens, token_ids, num_output_tokens = [], [], [], []
    num_prompt_tokens, num_cached_tokens, num_preemptions = [], [], []
    for output in outputs:
        if output.logprobs or output.prompt_logprobs or output.finished or output.timings is not None:
            msg.deltas.append(request_output_to_proto(output))
            continue
        request_ids.append(output.request_id)
        num_new_tokens.append(len(output.new_token_ids))
        token_ids += output.new_token_ids
        num_output_tokens.append(output.num_output_tokens)
        num_prompt_tokens.append(output.num_prompt_tokens)
        num_cached_tokens.append(output.num_cached_tokens)
        num_preemptions.append(output.num_preemptions)
    msg.request_ids.extend(request_ids)
    msg.num_new_tokens.extend(num_new_tokens)
    msg.token_ids.extend(token_ids)
    msg.num_output_tokens.extend(num_output_tokens)
    msg.num_prompt_tokens.extend(num_prompt_tokens)
    msg.num_cached_tokens.extend(num_cached_tokens)
    msg.num_preemptions.extend(num_preemptions)
    return msg


def step_deltas_from_proto(msg: scheduler_pb2.StepDeltas) -> list[RequestOutput]:
    """Every output of a StepDeltas message, its columns' and its entries'."""
    outputs = [request_output_from_proto(delta) for delta in msg.deltas]
    token_ids, end = list(msg.token_ids), 0
    for request_id, count, num_output, num_prompt, num_cached, num_preemptions in zip(
            msg.request_ids, msg.num_new_tokens, msg.num_output_tokens, msg.num_prompt_tokens,
            msg.num_cached_tokens, msg.num_preemptions):
        start, end = end, end + count
        outputs.append(RequestOutput(request_id, token_ids[start:end], num_prompt_tokens=num_prompt,
                                     num_output_tokens=num_output, num_cached_tokens=num_cached,
                                     num_preemptions=num_preemptions))
    if end != len(token_ids):
        raise ValueError(f"StepDeltas: the columns count {end} token ids, the message has {len(token_ids)}")
    return outputs


def request_output_from_proto(msg: scheduler_pb2.SubmitResponse) -> RequestOutput:
    return RequestOutput(
        request_id=msg.request_id,
        new_token_ids=list(msg.new_token_ids),
        logprobs=[token_logprobs_from_proto(entry) for entry in msg.logprobs],
        # the wire cannot tell "none" from "no entries" (a one-token prompt): both read as None; the
        # gateway knows whether it asked
        prompt_logprobs=[token_logprobs_from_proto(entry) for entry in msg.prompt_logprobs] or None,
        finished=msg.finished,
        finish_reason=finish_reason_from_proto(msg.finish_reason),
        num_prompt_tokens=msg.num_prompt_tokens,
        num_output_tokens=msg.num_output_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        num_preemptions=msg.num_preemptions,
        timings=timings_from_proto(msg.timings) if msg.HasField("timings") else None,
    )
