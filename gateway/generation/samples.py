"""n > 1 and best_of: several samples of one prompt, run side by side as sibling scheduler requests.

    check_streamable(prepared)                       # a stream=true / GenerateStream request
    deltas = stream_samples(prepared, call, side)    # gateway.generation.context; chosen by Generations.stream
    async with contextlib.aclosing(deltas):
        async for delta in deltas:                   # delta.index: the choice (0 .. n-1) it belongs to
            ...

Why sibling requests and no "group" notion in the scheduler: the scheduler registers a prompt's full
pages in the prefix cache as soon as the step that computes them is planned (scheduler.pages.kv_manager), and
admits waiting requests in order only while the step's token budget lasts. Of n requests with one
prompt sent to one replica at once, the first admitted computes the prompt; each other one is admitted
in the same step after it, or in a later one (never while the first still has prompt chunks left:
those take the whole budget), and finds the prompt's full pages cached, computing only the last partial
page (at least the last token, whose logits it samples from). So the prompt is computed once without
holding the siblings back (which would cost them TTFT) and without changing the scheduler; the samples
only have to reach the same replica, so they are routed once, together. usage cached_prompt_tokens
shows it per sample (tokenmill.v1 Choice.usage).

Sample i is the request `<id>-i` (n == best_of == 1: the request itself, unchanged). With a seed it
draws from seed + i (mod 2^64), as vLLM's parallel sampling does: reproducible, and different for each
sample (the worker hashes seed and position, so neighbouring seeds give unrelated streams); without one
each draws from the worker's shared RNG. Prompt logprobs (completions echo with logprobs) are asked of
every sample, so each choice streams its own echo at once: a request asking for them reads no
prefix-cache pages (scheduler), so there the prompt is computed per sample.

best_of > n: every sample gets logprobs (at least the chosen token's) to be ranked by; deltas are held
until all samples ended, then the n with the highest cumulative logprob are replayed, best first, as
indices 0 .. n-1, without logprobs the client did not ask for (vLLM's ranking; not streamable).

One sample failing (an error, a refusal, its scheduler gone) ends the request with that error and
cancels the others; the caller leaving cancels all: each cancelled call aborts its request and frees
its pages.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from core.errors import InvalidArgument
from gateway.generation.stream import GenerationDelta, stream_generation
from gateway.prepare.request_builder import PreparedRequest
from gateway.generation.context import CallContext, SchedulerSide
from gateway.telemetry import RequestObserver
from gateway.upstream.target import Route

_SEED_MODULUS = 2**64  # seeds are 64 bits unsigned on the wire


def check_streamable(prepared: PreparedRequest) -> None:
    """best_of > n cannot stream: the best samples are known only once every sample has ended."""
    if prepared.best_of > prepared.n:
        raise InvalidArgument("best_of", prepared.best_of,
                              f"must equal n ({prepared.n}) when streaming: the best samples are known only "
                              "once all have ended")


def sample_ids(prepared: PreparedRequest) -> list[str]:
    """The scheduler request ids of its samples: `<id>-<index>`, or the request's own id for one sample."""
    request_id = prepared.request.request_id
    return [request_id] if prepared.best_of == 1 else [f"{request_id}-{index}" for index in range(prepared.best_of)]


def sample_requests(prepared: PreparedRequest) -> list[PreparedRequest]:
    """The best_of sibling requests (just `prepared` when it asks for one sample)."""
    if prepared.best_of == 1:
        return [prepared]
    request, params = prepared.request, prepared.request.sampling_params
    ranked = prepared.best_of > prepared.n
    samples = []
    for index, sample_id in enumerate(sample_ids(prepared)):
        changes: dict = {}
        if params.seed is not None:
            changes["seed"] = (params.seed + index) % _SEED_MODULUS
        if ranked and params.logprobs is None:
            changes["logprobs"] = 0  # the chosen tokens' logprobs rank the samples
        sample = dataclasses.replace(request, request_id=sample_id,
                                     sampling_params=dataclasses.replace(params, **changes))
        samples.append(PreparedRequest(sample, prepared.stop))
    return samples


async def stream_samples(prepared: PreparedRequest, call: CallContext,
                         side: SchedulerSide) -> AsyncIterator[GenerationDelta]:
    """stream_generation for each sample, merged as they arrive (best_of > n: the n best, at the end);
    every sample on one scheduler (one prefix cache), under the call's deadline."""
    if prepared.best_of == 1:
        deltas = stream_generation(prepared, call, side)
    else:
        target = side.scheduler.route(prepared.request.prompt_token_ids)  # one replica: one prefix cache
        deltas = _merged([_sample(sample, call, side, target, index)
                          for index, sample in enumerate(sample_requests(prepared))])
        if prepared.best_of > prepared.n:
            keep_logprobs = prepared.request.sampling_params.logprobs is not None
            deltas = _best(deltas, prepared.n, keep_logprobs)
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            yield delta


async def _sample(sample: PreparedRequest, call: CallContext, side: SchedulerSide, target: Route,
                  index: int) -> AsyncIterator[GenerationDelta]:
    """One sample's stream; its observer is made here, in the task that runs it (_merged), and counts the
    client's prompt for the first sample only (RequestObserver)."""
    observer = RequestObserver(sample.request, call.arrival, counts_prompt=index == 0)
    deltas = stream_generation(sample, call, side, target=target, observer=observer)
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            yield delta


async def _merged(streams: list[AsyncIterator[GenerationDelta]]) -> AsyncIterator[GenerationDelta]:
    """The streams' deltas in arrival order, each with its stream's index; the first error ends all."""
    queue: asyncio.Queue = asyncio.Queue()  # a delta, an exception, or None when a stream has ended

    async def pump(index: int, stream: AsyncIterator[GenerationDelta]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    delta.index = index
                    queue.put_nowait(delta)
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(error)
        else:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                num_running -= 1
            else:
                yield item
    finally:  # an error, or the caller leaving: the samples still running are cancelled (and aborted)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _best(deltas: AsyncIterator[GenerationDelta], n: int, keep_logprobs: bool) -> AsyncIterator[GenerationDelta]:
    held: dict[int, list[GenerationDelta]] = {}
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            held.setdefault(delta.index, []).append(delta)
    ranked = sorted(held, key=lambda index: (-cumulative_logprob(held[index]), index))
    for rank, index in enumerate(ranked[:n]):
        for delta in held[index]:
            delta.index = rank
            if not keep_logprobs:
                delta.logprobs = []
            yield delta


def cumulative_logprob(deltas: list[GenerationDelta]) -> float:
    """The sum of a sample's token logprobs: how likely the model finds the whole sample."""
    return sum(entry.logprob for delta in deltas for entry in delta.logprobs)
