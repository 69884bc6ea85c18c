"""gateway.generation.stream.every_interval (--stream-interval): the first output at once, then one output
per `interval` tokens, and the finished one; tokens, logprobs and their order unchanged. Through the real
scheduler: tests/gateway/generation/test_generations.py."""
from __future__ import annotations

import contextlib
import itertools

import pytest

from core.outputs import FinishReason, RequestOutput
from core.step import TokenLogprobs
from gateway.generation.stream import every_interval


async def _outputs(count: int):
    for index in range(count):
        last = index == count - 1
        yield RequestOutput("r", [100 + index], [TokenLogprobs(-float(index))],
                            finished=last, finish_reason=FinishReason.LENGTH if last else None,
                            num_output_tokens=index + 1)


async def _sent(count: int, interval: int) -> list[RequestOutput]:
    async with contextlib.aclosing(every_interval(_outputs(count), interval)) as sent:
        return [output async for output in sent]


@pytest.mark.parametrize("count, interval, sizes", [
    (8, 1, [1] * 8),
    (8, 3, [1, 3, 3, 1]),  # the first at once, then every 3, and the finished one with what is left
    (7, 3, [1, 3, 3]),
    (1, 4, [1]),
    (5, 16, [1, 4]),
])
async def test_the_first_output_goes_at_once_then_one_per_interval_tokens_and_the_last(count, interval, sizes):
    sent = await _sent(count, interval)
    assert [len(output.new_token_ids) for output in sent] == sizes
    assert [token for output in sent for token in output.new_token_ids] == [100 + i for i in range(count)]
    assert [entry.logprob for output in sent for entry in output.logprobs] == [-float(i) for i in range(count)]
    assert [output.num_output_tokens for output in sent] == list(itertools.accumulate(sizes))
    assert sent[-1].finished and not any(output.finished for output in sent[:-1])


async def test_an_output_without_tokens_first_does_not_make_the_first_token_wait():
    async def outputs():
        yield RequestOutput("r", [], num_output_tokens=0)  # e.g. a message that only says where it starts
        for index in range(4):
            yield RequestOutput("r", [index], num_output_tokens=index + 1, finished=index == 3)

    async with contextlib.aclosing(every_interval(outputs(), 3)) as sent:
        assert [len(output.new_token_ids) async for output in sent] == [0, 1, 3]


async def test_leaving_early_closes_the_outputs_so_the_scheduler_call_is_cancelled():
    closed = []

    async def outputs():
        try:
            for index in range(10):
                yield RequestOutput("r", [index], num_output_tokens=index + 1)
        finally:
            closed.append(True)

    async with contextlib.aclosing(every_interval(outputs(), 2)) as sent:
        await anext(sent)
    assert closed == [True]
