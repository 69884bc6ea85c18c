"""The asyncio step loop the scheduler process runs: single owner, deadlines, aborts."""
from __future__ import annotations

import asyncio
import time

import pytest

from scheduler.config import SchedulerConfig
from core.errors import DeadlineExceeded
from core.outputs import FinishReason
from scheduler.process.loop import EngineLoop
from scheduler.scheduler import Scheduler
from tests.helpers.fake_executor import FakeExecutor
from tests.scheduler.conftest import make_request


class SlowAsyncExecutor:
    """The fake model behind an await, each step taking step_s (as a real forward pass would)."""

    def __init__(self, step_s: float) -> None:
        self.fake = FakeExecutor(64, 4)
        self.block_size, self.num_blocks, self.step_s = 4, 64, step_s

    async def execute(self, plan):
        await asyncio.sleep(self.step_s)
        return self.fake.execute(plan)


def make_loop(step_s: float = 0.0) -> EngineLoop:
    return EngineLoop(Scheduler(SchedulerConfig(num_blocks=64, block_size=4)), SlowAsyncExecutor(step_s))


async def drain(stream) -> list:
    outputs = []
    while not (outputs and outputs[-1].finished):
        outputs.append(await stream.queue.get())
    return outputs


async def test_loop_streams_every_token_then_finishes():
    loop = make_loop()
    loop.start()
    streams = [loop.submit(make_request([i + 1] * 5, max_tokens=6)) for i in range(3)]
    results = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), 5)
    await loop.stop()
    for outputs in results:
        assert sum(len(o.new_token_ids) for o in outputs) == 6 and outputs[-1].finish_reason is FinishReason.LENGTH
    assert not loop.streams and loop.scheduler.kv.pool.num_used == 0


async def test_deadline_mid_generation_ends_the_request_and_frees_its_pages():
    loop = make_loop(step_s=0.02)
    loop.start()
    stream = loop.submit(make_request([3] * 5, max_tokens=200), deadline=time.time() + 0.2)
    outputs = await asyncio.wait_for(drain(stream), 5)
    assert isinstance(outputs[-1].error, DeadlineExceeded) and 0 < len(outputs) < 200
    await asyncio.sleep(0.05)
    assert loop.scheduler.kv.pool.num_used == 0 and not loop.scheduler.requests
    await loop.stop()


async def test_deadline_already_past_never_runs():
    loop = make_loop()
    stream = loop.submit(make_request([3] * 5, max_tokens=10), deadline=time.time() - 1)
    loop.start()
    outputs = await asyncio.wait_for(drain(stream), 5)
    await loop.stop()
    assert len(outputs) == 1 and isinstance(outputs[0].error, DeadlineExceeded) and not outputs[0].new_token_ids
    assert loop.num_steps == 0


class RecordingTokens:
    """A token sink (the Redis writers' queue) that notes each hand-off in the shared event list."""

    def __init__(self, events: list) -> None:
        self.events = events

    def append(self, request_id, start_index, token_ids) -> None:
        self.events.append(("delivered", start_index + len(token_ids)))

    def finish(self, *args) -> None:
        pass


class RecordingSlowExecutor(SlowAsyncExecutor):
    def __init__(self, events: list) -> None:
        super().__init__(0.01)
        self.events = events

    def execute(self, plan):  # starts sending at once, as the gRPC worker client does
        self.events.append(("sent", plan.step_id))
        return super().execute(plan)


@pytest.mark.parametrize("async_scheduling", [False, True])
async def test_the_next_plan_goes_out_before_a_steps_tokens_are_handed_out(async_scheduling):
    """Issue 33: when step N's result comes, the plan of the step after it is sent first, then N's tokens
    go to the streams and the Redis writers' queue, so the worker's next step does not wait on them."""
    events: list = []
    loop = EngineLoop(Scheduler(SchedulerConfig(num_blocks=64, block_size=4)), RecordingSlowExecutor(events),
                      tokens=RecordingTokens(events), async_scheduling=async_scheduling)
    loop.start()
    stream = loop.submit(make_request([3] * 5, max_tokens=5), resumable=True)
    await asyncio.wait_for(drain(stream), 5)
    await loop.stop()
    # the first token (step 0's) is handed out after step 1 (sync) or step 2 (async: two ahead) was sent
    ahead = 2 if async_scheduling else 1
    first = events.index(("delivered", 1))
    assert ("sent", ahead) in events[:first], events
    for tokens in range(1, 4):  # and so on for every step that has a successor
        assert events.index(("sent", tokens - 1 + ahead)) < events.index(("delivered", tokens)), events


async def test_the_loop_is_async_scheduling_by_default():
    assert make_loop().pipeline.depth == 2
