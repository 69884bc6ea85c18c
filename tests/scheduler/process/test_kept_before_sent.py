"""A resumable request's outputs wait until its submission is kept in Redis (scheduler.process.request_streams):
a client that saw a token of a request the scheduler had not yet written down could lose it to a kill -9,
since a restarted scheduler re-admits only what it finds there (tests/e2e/test_faults.py killed it ~5 ms after
the first tokens and, now and then, nothing came back). Redis away degrades, never blocks: KEPT_WAIT_S at most."""
from __future__ import annotations

import asyncio

from core.outputs import FinishReason, RequestOutput
from scheduler.process import request_streams
from scheduler.process.request_streams import RequestStreams
from tests.scheduler.conftest import make_request


def _output(index: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [100 + index], finished=finished, num_output_tokens=index + 1,
                         finish_reason=FinishReason.LENGTH if finished else None)


def _drain(queue: asyncio.Queue) -> list[RequestOutput]:
    return [queue.get_nowait() for _ in range(queue.qsize())]


async def test_outputs_wait_for_the_submission_to_be_kept_then_go_as_one():
    streams, kept = RequestStreams(), asyncio.get_running_loop().create_future()
    stream = streams.open(make_request([1, 2, 3], request_id="r"), None, False, None, kept=kept)
    streams.deliver([_output(0)], forward_ns=1)
    streams.deliver([_output(1)], forward_ns=1)
    assert _drain(stream.queue) == []  # nothing leaves before the submission is in Redis
    kept.set_result(None)
    await asyncio.sleep(0)
    (first,) = _drain(stream.queue)
    assert first.new_token_ids == [100, 101] and first.num_output_tokens == 2
    streams.deliver([_output(2)], forward_ns=1)  # kept: straight through from now on
    assert [output.new_token_ids for output in _drain(stream.queue)] == [[102]]


async def test_a_request_that_ends_while_held_ends_with_what_it_held():
    streams, kept = RequestStreams(), asyncio.get_running_loop().create_future()
    stream = streams.open(make_request([1, 2, 3], request_id="r"), None, False, None, kept=kept)
    streams.deliver([_output(0)], forward_ns=1)
    streams.end(_output(1, finished=True))
    (last,) = _drain(stream.queue)
    assert last.finished and last.new_token_ids == [100, 101]
    kept.set_result(None)
    await asyncio.sleep(0)
    assert _drain(stream.queue) == []  # the release finds the request ended: nothing twice


async def test_without_redis_answering_the_outputs_go_out_after_the_wait(monkeypatch, caplog):
    monkeypatch.setattr(request_streams, "KEPT_WAIT_S", 0.05)
    streams, never = RequestStreams(), asyncio.get_running_loop().create_future()
    stream = streams.open(make_request([1, 2, 3], request_id="r"), None, False, None, kept=never)
    streams.deliver([_output(0)], forward_ns=1)
    await asyncio.sleep(0.1)
    assert [output.new_token_ids for output in _drain(stream.queue)] == [[100]]
    assert "not in Redis after 0.05s" in caplog.text


async def test_a_step_that_comes_between_the_keeping_and_its_callback_goes_after_what_was_held():
    """The future's done callbacks run a loop turn after it is set: a step delivered in between found it done
    and went out first, and the held outputs were then dropped by the release (it saw the hold over). Their
    tokens were lost: the gateway started the request at the step's index (the first message on the Submit
    call says where a request starts), and the full suite's recovery test got 159 of 160 tokens."""
    streams, kept = RequestStreams(), asyncio.get_running_loop().create_future()
    stream = streams.open(make_request([1, 2, 3], request_id="r"), None, False, None, kept=kept)
    streams.deliver([_output(0)], forward_ns=1)
    kept.set_result(None)
    streams.deliver([_output(1)], forward_ns=1)  # before the callback ran
    await asyncio.sleep(0)
    assert [(output.new_token_ids, output.num_output_tokens) for output in _drain(stream.queue)] == [
        ([100], 1), ([101], 2)]
