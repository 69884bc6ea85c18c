"""The gateway's side of the per-step delta stream: messages from a request's Submit call and from the
delta stream put back in order (gateway.upstream.delta_stream.in_order), never a token skipped; and the whole
hop against gateway_cluster's real scheduler, whose stream carries several requests' deltas per message."""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import grpc
import pytest

from core.errors import InvalidArgument, Unavailable
from core.outputs import FinishReason, RequestOutput
from gateway.upstream.delta_stream import LOST, FromSubmit, SubmitEnded, in_order
from gateway.upstream.scheduler_client import SchedulerClient
from protos import codec
from protos.tokenmill.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.gateway.upstream.test_scheduler_client import PROMPT, collect, request


def out(start: int, count: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", list(range(start, start + count)), num_output_tokens=start + count, finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None)


async def ordered(*items) -> list[RequestOutput]:
    queue: asyncio.Queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    result = []
    async with contextlib.aclosing(in_order(queue, "r")) as outputs:
        async for output in outputs:
            result.append(output)
    return result


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [token for output in outputs for token in output.new_token_ids]


async def test_deltas_that_overtake_the_first_message_wait_for_it():
    # the Submit call's first message waits for the request's record; the stream's deltas do not
    outputs = await ordered(out(1, 1), out(2, 2), FromSubmit(out(0, 1)), FromSubmit(out(4, 1, finished=True)),
                            SubmitEnded())
    assert tokens(outputs) == [0, 1, 2, 3, 4] and outputs[-1].finished


async def test_the_ending_waits_for_the_deltas_before_it():
    outputs = await ordered(FromSubmit(out(0, 1)), FromSubmit(out(3, 1, finished=True)), SubmitEnded(),
                            out(1, 1), out(2, 1))
    assert tokens(outputs) == [0, 1, 2, 3]


async def test_a_broken_delta_stream_with_nothing_in_flight_is_harmless():
    # the scheduler sends on the Submit call again once the stream is gone
    outputs = await ordered(FromSubmit(out(0, 1)), out(1, 1), LOST, FromSubmit(out(2, 1)),
                            FromSubmit(out(3, 1, finished=True)))
    assert tokens(outputs) == [0, 1, 2, 3]


async def test_tokens_lost_with_a_broken_delta_stream_fail_the_request_rather_than_skip():
    with pytest.raises(Unavailable, match=r"'r'.*from index 2"):
        await ordered(FromSubmit(out(0, 1)), out(1, 1), LOST, FromSubmit(out(4, 1, finished=True)))
    with pytest.raises(Unavailable, match="from index 1"):  # the gap shows when the first message lands
        await ordered(out(2, 1), LOST, FromSubmit(out(0, 1)))


async def test_a_submit_error_is_raised_and_a_clean_end_without_the_last_message_is_unavailable():
    with pytest.raises(InvalidArgument, match="prompt"):
        await ordered(SubmitEnded(InvalidArgument("prompt_token_ids[1]", 999, "out of vocabulary")))
    with pytest.raises(Unavailable, match="before its last message"):
        await ordered(FromSubmit(out(0, 1)), SubmitEnded())


async def test_outputs_queued_while_the_reader_was_busy_come_out_as_one():
    # its client was slow to take the last write: the stream writes once with every step it missed
    outputs = await ordered(FromSubmit(out(0, 1)), out(1, 1), out(2, 2), FromSubmit(out(4, 1, finished=True)),
                            SubmitEnded())
    assert [output.new_token_ids for output in outputs] == [[0, 1, 2, 3, 4]] and outputs[0].finished


async def test_a_reader_that_keeps_up_gets_each_output_as_it_comes():
    queue: asyncio.Queue = asyncio.Queue()
    queue.put_nowait(FromSubmit(out(0, 1)))
    async with contextlib.aclosing(in_order(queue, "r")) as outputs:
        seen = [(await anext(outputs)).new_token_ids]
        for start in (1, 2):
            queue.put_nowait(out(start, 1, finished=start == 2))
            seen.append((await anext(outputs)).new_token_ids)
    assert seen == [[0], [1], [2]]


async def test_a_coalesced_run_stops_at_a_gap_and_goes_on_when_it_fills():
    outputs = await ordered(FromSubmit(out(0, 1)), out(1, 1), out(3, 1), out(2, 1), FromSubmit(out(4, 1, True)))
    assert tokens(outputs) == [0, 1, 2, 3, 4] and len(outputs) == 1


async def test_the_delta_stream_batches_a_step_across_requests(gateway_cluster):
    """Raw calls to the real scheduler: three bound requests get their first and last message on their
    Submit calls and the rest in StepDeltas messages that each carry several of them."""
    async with grpc.aio.insecure_channel(gateway_cluster.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        stream_id = uuid.uuid4().hex
        deltas_call = stub.StreamDeltas(scheduler_pb2.StreamDeltasRequest(stream_id=stream_id))
        await asyncio.sleep(0.2)  # registered before the requests name it
        with pytest.raises(grpc.aio.AioRpcError) as taken:
            await stub.StreamDeltas(scheduler_pb2.StreamDeltasRequest(stream_id=stream_id)).read()
        assert taken.value.code() is grpc.StatusCode.ALREADY_EXISTS
        ids = [f"batched-{i}-{time.monotonic_ns()}" for i in range(3)]
        submits = []
        for request_id in ids:
            message = codec.submit_request_to_proto(request(request_id, max_tokens=12), None)
            message.delta_stream_id = stream_id
            submits.append(stub.Submit(message, timeout=60))
        own = await asyncio.wait_for(asyncio.gather(*(collect_call(call) for call in submits)), 60)
        received: list[scheduler_pb2.StepDeltas] = []
        while sum(len(d.new_token_ids) for m in received for d in m.deltas) < 3 * 12 - sum(
                len(r.new_token_ids) for call in own for r in call):
            received.append(await asyncio.wait_for(deltas_call.read(), 10))
        deltas_call.cancel()
    assert [len(messages) for messages in own] == [2, 2, 2] and all(m[-1].finished for m in own)
    assert max(len(message.deltas) for message in received) >= 2  # one message, several requests' tokens
    for request_id, messages in zip(ids, own):
        pieces = [d for message in received for d in message.deltas if d.request_id == request_id] + messages
        pieces.sort(key=lambda d: d.num_output_tokens - len(d.new_token_ids))
        assert sum(len(p.new_token_ids) for p in pieces) == 12 == pieces[-1].num_output_tokens


async def collect_call(call) -> list[scheduler_pb2.SubmitResponse]:
    return [message async for message in call]


async def test_the_client_gets_the_same_tokens_with_and_without_the_delta_stream(gateway_cluster):
    batched = SchedulerClient(gateway_cluster.scheduler_address)
    plain = SchedulerClient(gateway_cluster.scheduler_address, delta_stream=False)
    try:
        runs = {}
        for name, client in (("batched", batched), ("plain", plain)):
            results = await asyncio.gather(*(
                collect(client.submit(request(f"{name}-{i}-{time.monotonic_ns()}", max_tokens=10,
                                              prompt=PROMPT + [100 + i]), timeout_s=60)) for i in range(4)))
            runs[name] = [tokens(outputs) for outputs in results]
            assert all(outputs[-1].finished and outputs[-1].num_output_tokens == 10 for outputs in results)
        assert runs["batched"] == runs["plain"] and all(len(t) == 10 for t in runs["batched"])
        assert batched._deltas.stream_id and batched._deltas._task is not None and not batched._deltas._task.done()
    finally:
        await batched.close()
        await plain.close()
