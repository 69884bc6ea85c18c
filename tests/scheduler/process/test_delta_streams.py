"""A gateway's delta stream in the scheduler process: a step's deltas for all bound requests as one
batch, each request's first and last on its own stream, contiguous by num_output_tokens (what the
gateway orders by), and its own stream again once the delta stream closes."""
from __future__ import annotations

import asyncio

import pytest

from core.errors import AlreadyExists
from core.outputs import RequestOutput
from scheduler.config import SchedulerConfig
from scheduler.process.delta_streams import DeltaStream
from scheduler.process.loop import EngineLoop
from scheduler.scheduler import Scheduler
from tests.scheduler.conftest import make_request
from tests.scheduler.process.test_engine_loop import SlowAsyncExecutor, drain

PROMPTS = ([5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24])


def make_loop(async_scheduling: bool) -> EngineLoop:
    return EngineLoop(Scheduler(SchedulerConfig(num_blocks=64, block_size=4)), SlowAsyncExecutor(0.005),
                      async_scheduling=async_scheduling)


async def batches_until(deltas: DeltaStream, done: asyncio.Future) -> list[list[RequestOutput]]:
    batches = []
    while not done.done() or not deltas._queue.empty():
        waiter = asyncio.ensure_future(deltas.next_batch())
        finished, _ = await asyncio.wait({waiter, done}, return_when=asyncio.FIRST_COMPLETED)
        if waiter in finished:
            batches.append(waiter.result())
        else:
            waiter.cancel()
    return batches


async def run(async_scheduling: bool, delta_stream_id: str, max_tokens: int = 8):
    """Each request's own outputs, the delta stream's batches, and the loop."""
    loop = make_loop(async_scheduling)
    deltas = loop.streams.delta_streams.open("gw-1")
    loop.start()
    streams = [loop.submit(make_request(prompt, max_tokens=max_tokens, request_id=f"q{i}"),
                           delta_stream_id=delta_stream_id) for i, prompt in enumerate(PROMPTS)]
    own = asyncio.ensure_future(asyncio.gather(*(drain(stream) for stream in streams)))
    batches = await asyncio.wait_for(batches_until(deltas, own), 10)
    await loop.stop()
    return own.result(), batches, loop


def tokens_in_order(outputs: list[RequestOutput]) -> list[int]:
    """The tokens of one request's outputs, checking they tile [0, n) by num_output_tokens."""
    tokens = []
    for output in sorted(outputs, key=lambda o: o.num_output_tokens - len(o.new_token_ids)):
        assert output.num_output_tokens - len(output.new_token_ids) == len(tokens), "a gap or an overlap"
        tokens += output.new_token_ids
    return tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_a_step_goes_out_as_one_batch_and_both_sources_tile_each_request(async_scheduling):
    plain, no_batches, _ = await run(async_scheduling, delta_stream_id="")
    assert no_batches == []  # unbound requests never use it
    own, batches, loop = await run(async_scheduling, delta_stream_id="gw-1")
    # on its own stream: the first message and the ending, nothing between
    assert [len(outputs) for outputs in own] == [2] * len(PROMPTS)
    assert all(outputs[-1].finished and not outputs[0].finished for outputs in own)
    # the three requests decode in the same steps: most batches carry all three, each once
    assert all(len({o.request_id for o in batch}) == len(batch) for batch in batches)
    assert max(len(batch) for batch in batches) == len(PROMPTS)
    assert not any(o.finished for batch in batches for o in batch)
    for index, (outputs, alone) in enumerate(zip(own, plain)):
        from_deltas = [o for batch in batches for o in batch if o.request_id == f"q{index}"]
        assert tokens_in_order(outputs + from_deltas) == tokens_in_order(alone)  # same greedy tokens
        assert len(tokens_in_order(alone)) == 8
    assert not loop.streams


async def test_a_reader_that_fell_behind_gets_one_entry_per_request():
    deltas = DeltaStream("gw")
    for step in range(3):
        for request_id in ("a", "b"):
            deltas.add(RequestOutput(request_id, [100 + step], num_output_tokens=2 + step))
        deltas.flush()
    merged = await deltas.next_batch()
    assert [(o.request_id, o.new_token_ids, o.num_output_tokens) for o in merged] == [
        ("a", [100, 101, 102], 4), ("b", [100, 101, 102], 4)]


async def test_after_the_delta_stream_closes_the_deltas_come_on_each_request_s_own_stream():
    loop = make_loop(async_scheduling=False)
    deltas = loop.streams.delta_streams.open("gw-1")
    with pytest.raises(AlreadyExists, match="gw-1"):
        loop.streams.delta_streams.open("gw-1")
    loop.start()
    stream = loop.submit(make_request(PROMPTS[0], max_tokens=30, request_id="long"), delta_stream_id="gw-1")
    first = await asyncio.wait_for(stream.queue.get(), 5)
    await asyncio.wait_for(deltas.next_batch(), 5)  # a step went to the delta stream
    loop.streams.delta_streams.close(deltas)
    assert loop.streams.delta_streams.get("gw-1") is None
    rest = await asyncio.wait_for(drain(stream), 5)
    await loop.stop()
    assert len(rest) > 2 and rest[-1].finished and rest[-1].num_output_tokens == 30
    # from the close on, every step's delta on its own stream, one after another (what the closed call
    # had queued unsent went with it)
    assert first.num_output_tokens == 1
    assert all(later.num_output_tokens - len(later.new_token_ids) == earlier.num_output_tokens
               for earlier, later in zip(rest, rest[1:]))
