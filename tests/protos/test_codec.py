"""Round trips through protos.codec, over the wire bytes (serialize + parse), as the RPCs do."""
from __future__ import annotations

import time

import pytest

from core.outputs import FinishReason, RequestOutput, RequestTimings
from core.requests import GenerationRequest
from core.sampling import SamplingParams
from core.step import CachedRequestData, NewRequestData, StepPlan, StepResult, TokenLogprobs
from protos import codec
from protos.tokenmill.v1 import common_pb2, sampling_pb2, worker_pb2


def over_the_wire(msg):
    return type(msg).FromString(msg.SerializeToString())


FULL_PARAMS = SamplingParams(
    max_tokens=300,
    temperature=0.7,
    top_k=40,
    top_p=0.9,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=-0.5,
    frequency_penalty=0.25,
    seed=2**40 + 3,
    stop_token_ids=(2, 7),
    ignore_eos=True,
    logprobs=5,
)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        FULL_PARAMS,
        SamplingParams(temperature=0.0, top_k=0, seed=0, logprobs=0),  # zeros that mean something
    ],
    ids=["defaults", "every-field", "zeros"],
)
def test_sampling_params_round_trip(params):
    assert codec.sampling_params_from_proto(over_the_wire(codec.sampling_params_to_proto(params))) == params


def test_seed_and_logprobs_none_differ_from_zero():
    none = over_the_wire(codec.sampling_params_to_proto(SamplingParams(seed=None, logprobs=None)))
    zero = over_the_wire(codec.sampling_params_to_proto(SamplingParams(seed=0, logprobs=0)))
    assert not none.HasField("seed") and not none.HasField("logprobs")
    assert zero.HasField("seed") and zero.HasField("logprobs")
    assert codec.sampling_params_from_proto(none).seed is None
    assert codec.sampling_params_from_proto(zero).logprobs == 0


def test_unset_proto_fields_take_domain_defaults_not_zero():
    # An empty message must not turn into greedy, top_p=0, max_tokens=0 sampling.
    assert codec.sampling_params_from_proto(sampling_pb2.SamplingParams()) == SamplingParams()


def make_plan() -> StepPlan:
    return StepPlan(
        step_id=41,
        new_requests=[
            NewRequestData(
                request_id="new-a",
                token_ids=[1, 2, 3, 4, 5, 6],
                num_prompt_tokens=4,  # resumed after a preemption: 2 outputs already
                sampling_params=FULL_PARAMS,
                block_ids=[9, 3],
                num_computed_tokens=4,
            )
        ],
        cached_requests=[
            CachedRequestData(request_id="old-b", new_block_ids=[12], num_computed_tokens=31),
            CachedRequestData(request_id="old-c", new_block_ids=[], num_computed_tokens=7),
        ],
        # deliberately not sorted by id or by list order above
        num_scheduled_tokens={"old-c": 1, "new-a": 2, "old-b": 1},
        finished_request_ids=["gone-x", "gone-y"],
        swap_out=[(4, 0), (5, 1)],  # (device page, host page), in the order the worker copies them
        swap_in=[(2, 7)],
    )


@pytest.mark.parametrize("columns", [False, True], ids=["entries", "columns"])
def test_step_plan_round_trip_keeps_everything_and_batch_order(columns):
    """columns: the batch as StepPlan's two columns, for a worker that reports columnar_steps; entries: one
    ScheduledTokens per request, what an older worker reads (and what the decoder still takes)."""
    plan = make_plan()
    msg = over_the_wire(codec.step_plan_to_proto(plan, columns))
    assert len(msg.num_scheduled_tokens) == (0 if columns else 3) and len(msg.batch_request_ids) == (3 if columns else 0)
    assert len(msg.cached_requests) == (0 if columns else 2) and len(msg.cached_request_ids) == (2 if columns else 0)
    decoded = codec.step_plan_from_proto(msg)
    assert decoded == plan
    assert list(decoded.num_scheduled_tokens) == ["old-c", "new-a", "old-b"]


@pytest.mark.parametrize("columns", [False, True], ids=["entries", "columns"])
def test_speculative_step_round_trip(columns):
    """Drafts ride with their request's scheduled count, accepted tokens with its sampled one, and dropped tail
    pages with its diff; requests without any keep none."""
    plan = StepPlan(step_id=9, cached_requests=[CachedRequestData("a", [4], 30, num_dropped_block_ids=2),
                                                CachedRequestData("b", [], 12)],
                    num_scheduled_tokens={"a": 4, "b": 1}, spec_token_ids={"a": [7, 0, 49151]})
    assert codec.step_plan_from_proto(over_the_wire(codec.step_plan_to_proto(plan, columns))) == plan
    result = StepResult(step_id=9, sampled_token_ids={"a": 5, "b": 6}, accepted_token_ids={"a": [7, 0]},
                        logprobs={"a": TokenLogprobs(-0.5, [(5, -0.5)])},
                        accepted_logprobs={"a": [TokenLogprobs(-0.25, [(7, -0.25)]), TokenLogprobs(0.0)]})
    msg = over_the_wire(codec.step_result_to_proto(result, columns))
    assert [entry.request_id for entry in msg.sampled_tokens] == (["a"] if columns else ["a", "b"])
    assert codec.step_result_from_proto(msg) == result


@pytest.mark.parametrize("columns", [False, True], ids=["entries", "columns"])
def test_draft_model_step_round_trip(columns):
    """--speculative draft: how many guesses the worker makes for a request rides with its scheduled count, and the
    guesses with its sampled token; requests without any keep none."""
    plan = StepPlan(step_id=3, num_scheduled_tokens={"a": 3, "b": 1, "c": 16}, spec_token_ids={"a": [9, 8]},
                    num_draft_tokens={"a": 4, "b": 1})
    msg = over_the_wire(codec.step_plan_to_proto(plan, columns))
    assert sorted(entry.request_id for entry in msg.num_scheduled_tokens) == (["a", "b"] if columns else ["a", "b", "c"])
    assert codec.step_plan_from_proto(msg) == plan
    result = StepResult(step_id=3, sampled_token_ids={"a": 5, "b": 6}, accepted_token_ids={"a": [9]},
                        draft_token_ids={"a": [1, 0, 49151, 7], "b": [2]})
    assert codec.step_result_from_proto(over_the_wire(codec.step_result_to_proto(result, columns))) == result


@pytest.mark.parametrize("columns", [False, True], ids=["entries", "columns"])
def test_empty_plan_round_trip(columns):
    plan = StepPlan(step_id=0)
    msg = over_the_wire(codec.step_plan_to_proto(plan, columns))
    decoded = codec.step_plan_from_proto(msg)
    assert decoded == plan and decoded.is_empty


@pytest.mark.parametrize("columns", [False, True], ids=["entries", "columns"])
def test_step_result_round_trip_with_and_without_logprobs(columns):
    result = StepResult(
        step_id=41,
        sampled_token_ids={"old-c": 17, "new-a": 0, "old-b": 49151},
        logprobs={
            "new-a": TokenLogprobs(logprob=-0.25, top=[(0, -0.25), (5, -1.5), (8, -3.0)]),
            # logprobs=0: the chosen token's logprob only, which may be exactly 0.0
            "old-b": TokenLogprobs(logprob=0.0, top=[]),
        },
        forward_ns=1_234_567,
    )
    msg = over_the_wire(codec.step_result_to_proto(result, columns))
    assert len(msg.sampled_tokens) == (2 if columns else 3)  # columns: the two with logprobs only
    decoded = codec.step_result_from_proto(msg)
    assert decoded == result
    assert list(decoded.sampled_token_ids) == ["old-c", "new-a", "old-b"]
    assert "old-c" not in decoded.logprobs


def test_step_result_rejects_logprobs_without_a_sampled_token():
    result = StepResult(step_id=3, sampled_token_ids={"a": 1}, logprobs={"b": TokenLogprobs(-1.0)})
    with pytest.raises(ValueError, match=r"step 3: logprobs for requests that sampled no token: \['b'\]"):
        codec.step_result_to_proto(result)


def test_submit_request_round_trip_with_deadline():
    request = GenerationRequest("r-1", [5, 6, 7], FULL_PARAMS, eos_token_id=2, priority=-3)
    msg = over_the_wire(codec.submit_request_to_proto(request, deadline_unix_s=1_700_000_000.25, resumable=True,
                                                      owner="alice"))
    assert codec.generation_request_from_submit_proto(msg) == request
    assert (msg.resumable, msg.owner) == (True, "alice")
    assert codec.deadline_from_submit_proto(msg) == pytest.approx(1_700_000_000.25, abs=1e-6)


def test_submit_request_carries_the_keys_latency_targets():
    request = GenerationRequest("r-3", [5], SamplingParams(), target_itl_ms=25.0, target_ttft_ms=0.1)
    msg = over_the_wire(codec.submit_request_to_proto(request))
    assert msg.HasField("target_itl_ms") and msg.HasField("target_ttft_ms")
    assert codec.generation_request_from_submit_proto(msg) == request  # 0.1 exactly: a double on the wire
    only_itl = GenerationRequest("r-4", [5], SamplingParams(), target_itl_ms=7.5)
    assert codec.generation_request_from_submit_proto(over_the_wire(codec.submit_request_to_proto(only_itl))) == only_itl


def test_submit_request_without_eos_or_deadline():
    msg = over_the_wire(codec.submit_request_to_proto(GenerationRequest("r-2", [1], SamplingParams())))
    assert not msg.HasField("target_itl_ms") and not msg.HasField("target_ttft_ms")
    assert codec.generation_request_from_submit_proto(msg).target_itl_ms is None
    assert codec.generation_request_from_submit_proto(msg).eos_token_id is None
    assert codec.deadline_from_submit_proto(msg) is None
    assert (msg.resumable, msg.owner) == (False, "")


def test_finish_reasons_cover_every_domain_reason():
    for reason in [None, *FinishReason]:
        assert codec.finish_reason_from_proto(codec.finish_reason_to_proto(reason)) is reason
    with pytest.raises(ValueError, match="finish_reason='timeout' is not a FinishReason or None"):
        codec.finish_reason_to_proto("timeout")
    assert set(common_pb2.FinishReason.values()) == {codec.finish_reason_to_proto(r) for r in [None, *FinishReason]}


def test_request_output_round_trip_with_timings():
    output = RequestOutput("r-3", [4, 5], [TokenLogprobs(-0.5, [(4, -0.5)]), TokenLogprobs(-1.0)], finished=True,
                           finish_reason=FinishReason.LENGTH, num_prompt_tokens=3, num_output_tokens=2,
                           num_cached_tokens=1, num_preemptions=1, timings=RequestTimings(1, 2, 3, 4, 5))
    assert codec.request_output_from_proto(over_the_wire(codec.request_output_to_proto(output))) == output
    unfinished = RequestOutput("r-4", [7])
    assert codec.request_output_from_proto(over_the_wire(codec.request_output_to_proto(unfinished))) == unfinished


@pytest.mark.parametrize("columns", [False, True], ids=["entries", "columns"])
def test_step_deltas_round_trip(columns):
    """A gateway's StepDeltas: with columns, the outputs of counts and tokens alone ride as columns and only
    the others (logprobs, prompt logprobs) as entries; the gateway gets every output back either way."""
    plain = [RequestOutput("a", [4, 5], num_prompt_tokens=3, num_output_tokens=7, num_cached_tokens=1,
                           num_preemptions=2),
             RequestOutput("b", [0], num_prompt_tokens=9, num_output_tokens=1),
             RequestOutput("c", [], num_output_tokens=4)]  # no new tokens (a catch-up of nothing)
    rich = [RequestOutput("d", [6], [TokenLogprobs(-0.5, [(6, -0.5)])], num_output_tokens=2),
            RequestOutput("e", [8], prompt_logprobs=[TokenLogprobs(-2.0)], num_output_tokens=1)]
    msg = over_the_wire(codec.step_deltas_to_proto([plain[0], rich[0], plain[1], rich[1], plain[2]], columns))
    assert [delta.request_id for delta in msg.deltas] == (["d", "e"] if columns else ["a", "d", "b", "e", "c"])
    decoded = {output.request_id: output for output in codec.step_deltas_from_proto(msg)}
    assert decoded == {output.request_id: output for output in plain + rich}


def test_step_deltas_columns_that_disagree_are_refused():
    msg = codec.step_deltas_to_proto([RequestOutput("a", [4, 5], num_output_tokens=2)], columns=True)
    msg.token_ids.append(9)
    with pytest.raises(ValueError, match="the columns count 2 token ids, the message has 3"):
        codec.step_deltas_from_proto(msg)


@pytest.mark.parametrize("columns", [False, True], ids=["entries", "columns"])
def test_decode_plan_codec_speed(columns):
    """Measured, not asserted: the plan and result cross the wire every step."""
    num_requests = 32
    plan = StepPlan(
        step_id=1000,
        cached_requests=[
            CachedRequestData(f"req-{i:04d}", new_block_ids=[i] if i % 16 == 0 else [], num_computed_tokens=400 + i)
            for i in range(num_requests)
        ],
        num_scheduled_tokens={f"req-{i:04d}": 1 for i in range(num_requests)},
    )
    result = StepResult(step_id=1000, sampled_token_ids={f"req-{i:04d}": 100 + i for i in range(num_requests)})
    repeats = 500

    def measure(encode, decode, value) -> tuple[float, int]:
        start = time.perf_counter()
        for _ in range(repeats):
            data = encode(value, columns).SerializeToString()
            decoded = decode(data)
        elapsed_us = (time.perf_counter() - start) / repeats * 1e6
        assert decoded == value
        return elapsed_us, len(data)

    plan_us, plan_bytes = measure(
        codec.step_plan_to_proto, lambda data: codec.step_plan_from_proto(worker_pb2.StepPlan.FromString(data)), plan
    )
    result_us, result_bytes = measure(
        codec.step_result_to_proto,
        lambda data: codec.step_result_from_proto(worker_pb2.StepResult.FromString(data)),
        result,
    )
    print(
        f"\n{num_requests}-request decode step, {'columns' if columns else 'entries'}: plan encode+serialize+parse+"
        f"decode {plan_us:.0f} us ({plan_bytes} B), result {result_us:.0f} us ({result_bytes} B)"
    )


def test_cached_columns_that_disagree_are_refused():
    msg = codec.step_plan_to_proto(make_plan(), columns=True)
    msg.cached_new_block_ids.append(3)
    with pytest.raises(ValueError, match="the cached columns count 1 new page ids, the message has 2"):
        codec.step_plan_from_proto(msg)
