"""The gateway -> scheduler hop through typed calls, against the real scheduler of gateway_cluster:
GenerationRequest in, RequestOutput out, refusals as core.errors types, aborts by FinishReason."""
from __future__ import annotations

import contextlib
import time

import pytest

from core.errors import AlreadyExists, InvalidArgument, ResourceExhausted, ServingError
from core.outputs import FinishReason, RequestOutput
from core.requests import GenerationRequest
from core.sampling import SamplingParams
from gateway.upstream.scheduler_client import SchedulerClient

PROMPT = [1, 504, 3458, 282]  # any in-vocabulary ids


def request(request_id: str, max_tokens: int = 4, prompt: list[int] = PROMPT) -> GenerationRequest:
    return GenerationRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                ignore_eos=True), eos_token_id=2)


async def collect(outputs) -> list[RequestOutput]:
    async with contextlib.aclosing(outputs):
        return [output async for output in outputs]


async def test_outputs_are_typed_and_the_last_carries_reason_and_timings(gateway_cluster):
    client = SchedulerClient(gateway_cluster.scheduler_address)
    try:
        outputs = await collect(client.submit(request(f"typed-{time.monotonic_ns()}"), owner="alice",
                                              deadline_unix_s=time.time() + 60, timeout_s=60))
        assert all(isinstance(output, RequestOutput) for output in outputs)
        assert sum(len(output.new_token_ids) for output in outputs) == 4
        last = outputs[-1]
        assert last.finished and last.finish_reason is FinishReason.LENGTH and last.error is None
        assert (last.num_prompt_tokens, last.num_output_tokens) == (len(PROMPT), 4)
        assert last.timings is not None and last.timings.e2e_ns >= last.timings.time_to_first_token_ns > 0
        assert all(output.timings is None for output in outputs[:-1])
    finally:
        await client.close()


async def test_refusals_arrive_as_core_error_types(gateway_cluster):
    client = SchedulerClient(gateway_cluster.scheduler_address)
    try:
        with pytest.raises(InvalidArgument, match=r"prompt_token_ids\[1\]=999999"):
            await collect(client.submit(request("bad-id", prompt=[1, 999_999])))
        with pytest.raises(ServingError) as caught:  # the base class: whatever kind it is, it is typed
            await collect(client.submit(request("bad-max", max_tokens=10**9)))
        assert isinstance(caught.value, (InvalidArgument, ResourceExhausted))
    finally:
        await client.close()


async def test_a_taken_id_is_already_exists_and_abort_takes_a_finish_reason(gateway_cluster):
    client = SchedulerClient(gateway_cluster.scheduler_address)
    request_id = f"taken-{time.monotonic_ns()}"
    long_one = client.submit(request(request_id, max_tokens=1000), timeout_s=60)
    try:
        first = await anext(long_one)  # running now
        assert first.request_id == request_id
        with pytest.raises(AlreadyExists):
            await collect(client.submit(request(request_id)))
        assert await client.abort([request_id, "never-submitted"], FinishReason.STOP) == [request_id]
        rest = [output async for output in long_one]
        assert rest[-1].finished and rest[-1].finish_reason is FinishReason.STOP
    finally:
        await long_one.aclose()
        await client.close()
