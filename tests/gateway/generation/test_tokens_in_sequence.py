"""stream_generation takes a request's outputs only in sequence: an output whose tokens do not start where the
last one ended ends the stream UNAVAILABLE rather than hand the client a stream with tokens missing, whose
usage would still count them (the scheduler once dropped a resumable request's first output: the client got
159 of 160 tokens and finish_reason length)."""
from __future__ import annotations

import time

import pytest

from core.errors import Unavailable
from core.outputs import FinishReason, RequestOutput
from gateway.generation.context import CallContext, SchedulerSide
from gateway.generation.stream import stream_generation
from gateway.prepare.request_builder import prepare_request
from gateway.prepare.validation import ClientSampling, Limits
from gateway.text.tokenizer import load_tokenizer
from gateway.upstream.circuit_breaker import CircuitBreaker


class ScriptedScheduler:
    """Sends each (first index, tokens) output as given, the last one finished."""

    def __init__(self, script: list[tuple[int, list[int]]]) -> None:
        self.script, self.breaker, self.address = script, CircuitBreaker("scripted"), "127.0.0.1:1"

    def route(self, prompt_token_ids):
        return self

    async def submit(self, request, **options):
        for number, (start, tokens) in enumerate(self.script, 1):
            last = number == len(self.script)
            yield RequestOutput(request.request_id, tokens, num_prompt_tokens=3, num_output_tokens=start + len(tokens),
                                finished=last, finish_reason=FinishReason.LENGTH if last else None)

    async def abort(self, request_ids, reason=None):
        return request_ids


async def _tokens(script: list[tuple[int, list[int]]], scheduler: ScriptedScheduler | None = None) -> list[int]:
    tokenizer = load_tokenizer(None)
    request = prepare_request([12, 34, 56], tokenizer, Limits(max_model_len=2048, vocab_size=49152),
                              sampling=ClientSampling(max_tokens=4), request_id="r")
    side = SchedulerSide(tokenizer, scheduler or ScriptedScheduler(script), lambda *_: None)
    deltas = stream_generation(request, CallContext(time.monotonic()), side)
    return [token async for delta in deltas for token in delta.token_ids]


async def test_outputs_in_sequence_pass_whole():
    assert await _tokens([(0, [101]), (1, [102, 103]), (3, [104])]) == [101, 102, 103, 104]


@pytest.mark.parametrize("script, start, received", [
    ([(1, [102]), (2, [103, 104])], 1, 0),  # the first output lost
    ([(0, [101]), (2, [103]), (3, [104])], 2, 1),  # one in the middle
    ([(0, [101, 102]), (1, [102]), (2, [103, 104])], 1, 2),  # one sent twice
])
async def test_an_output_out_of_sequence_ends_the_stream_unavailable(script, start, received):
    scheduler = ScriptedScheduler(script)
    with pytest.raises(Unavailable, match=f"tokens from index {start} after {received} tokens"):
        await _tokens(script, scheduler)
    # one request's outputs went wrong, the scheduler is not away: its breaker is untouched
    assert scheduler.breaker._failures == 0
