"""A Submit call's life on the loop, without protobuf: the request joins the EngineLoop, its outputs go
to the call as they come (adjacent deltas coalesced), its end is recorded, and a call that goes away
early either aborts its request or, resumable, leaves it running for a client to resume by id. And, at
shutdown, the calls still open are ended with DrainTimeout (drain).

The servicer (scheduler.process.service) converts the SubmitRequest, calls follow() once and converts each
output back as it writes it.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from core.errors import DrainTimeout
from core.outputs import FinishReason, RequestOutput, RequestTimings, coalesce
from core.requests import GenerationRequest
from scheduler.process.loop import EngineLoop
from scheduler.process.request_streams import RequestStream, RequestTimes
from scheduler.process.telemetry import (CLIENT_DISCONNECT, finish_cause, record_deadline_cut, record_request_end,
                                         start_request)
from scheduler.request import Request

# A call cut this close to its deadline was cut by it: by gRPC here, or by the gateway, which drops the
# call when its own client's deadline passes, a few milliseconds before this call's (sent as the time
# left when the gateway made the call)
DEADLINE_SLACK_S = 0.05


@dataclass(frozen=True, slots=True)
class Submission:
    """What a Submit call asks for, in domain terms."""

    spec: GenerationRequest
    deadline: float | None  # wall-clock seconds; None: none
    resumable: bool  # asked for: it outlives the call (honoured only with a token stream to resume from)
    owner: str | None = None  # who may read and cancel it by id (set by a gateway)
    delta_stream_id: str = ""  # its gateway's StreamDeltas call, for the deltas after the first


async def follow(loop: EngineLoop, submission: Submission, send: Callable[[RequestOutput], Awaitable[None]],
                 time_remaining: Callable[[], float | None]) -> None:
    """Submits the request and sends its outputs until the last one. send raises when the call is cut (a
    deadline, the gateway gone): the clean-up then runs at once, in this task, under the call's live span.
    time_remaining: the call's (None: no deadline), to tell a deadline's cut from a client gone away."""
    # a resumable request outlives this call (its gateway may die): its caller aborts it explicitly
    resumable = submission.resumable and loop.tokens is not None
    # worker step spans link to this call's span through the request's trace context
    request = Request.from_generation_request(submission.spec, trace_context=start_request(submission.spec.request_id))
    stream = loop.submit(request, submission.deadline, resumable, owner=submission.owner,
                         delta_stream_id=submission.delta_stream_id)
    finished = False
    first = True
    try:
        while not finished:
            output = await _next_output(loop, stream, request.request_id, first)
            first, finished = False, output.finished
            if output.error is not None:  # typed: the edge maps it to its status (plumbing.rpc)
                raise output.error
            await send(output)
    finally:
        if not finished:
            _left_early(loop, stream, request.request_id, resumable, time_remaining())


async def _next_output(loop: EngineLoop, stream: RequestStream, request_id: str, first: bool) -> RequestOutput:
    """The stream's next output, with the adjacent deltas queued behind it; the last one carries its timings."""
    output = await stream.queue.get()
    # coalesce deltas that piled up while this client was slow to read; only adjacent ones
    # (with a delta stream, the deltas between the first and the last went there)
    while not output.finished and not stream.queue.empty() and _adjacent(output, stream.queue):
        output = coalesce(output, stream.queue.get_nowait())
    if first or output.finished:
        # GetRequestStatus (answered from Redis) must know the id by the time the client
        # has its first message, and know how it ended by the time it has the last
        await loop.streams.recorded(request_id)
    if output.finished:  # an error ending reads "error" whatever the reason beside it (a deadline's is abort)
        reason = FinishReason.ERROR if output.error is not None else output.finish_reason
        record_request_end(stream.times, output.num_preemptions, reason, finish_cause(output.error))
        output.timings = _timings(stream.times)
    return output


def _left_early(loop: EngineLoop, stream: RequestStream, request_id: str, resumable: bool,
                remaining_s: float | None) -> None:
    """The call ended before the request did: records why, then frees its pages or lets it run on."""
    if remaining_s is not None and remaining_s <= DEADLINE_SLACK_S:
        record_deadline_cut(stream.times, request_id)
    elif stream.abort_reason is not None:  # dropped after asking for the abort
        record_request_end(stream.times, finish_reason=stream.abort_reason)
    else:  # the gateway dropped the call: its client went away (or the gateway did)
        record_request_end(stream.times, finish_reason=FinishReason.ABORT, cause=CLIENT_DISCONNECT)
    if not resumable:  # the client went away or cancelled: free its pages
        loop.abort(request_id)
    else:  # runs on for a client to resume by id; an orphan if none does (scheduler.process.orphans)
        loop.streams.detach(request_id)


def _timings(times: RequestTimes) -> RequestTimings:
    def ns(start: float | None, end: float | None) -> int:
        return int((end - start) * 1e9) if start is not None and end is not None else 0

    return RequestTimings(queue_ns=ns(times.arrival, times.first_scheduled),
                          time_to_first_token_ns=ns(times.arrival, times.first_token),
                          decode_ns=ns(times.first_token, times.finished), e2e_ns=ns(times.arrival, times.finished),
                          first_token_forward_ns=times.first_token_forward_ns)


def _adjacent(output: RequestOutput, queue: asyncio.Queue) -> bool:
    """Whether the next queued output's tokens follow output's with none between."""
    more = queue._queue[0]  # noqa: SLF001 - asyncio.Queue has no peek
    return more.num_output_tokens - len(more.new_token_ids) == output.num_output_tokens


async def drain(loop: EngineLoop, timeout_s: float, drain_timeout_s: float) -> None:
    """Waits for in-flight requests to finish (graceful shutdown), at most timeout_s; then ends the
    calls of those left with DrainTimeout (UNAVAILABLE, recorded as ended by the drain), rather than
    leaving them to be cut by the server's stop, which reads as their gateway gone. The requests stay
    as they are: a resumable one runs on in the scheduler that restarts here (scheduler.process.readmission).
    drain_timeout_s: the whole drain's, for the message."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while loop.streams and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    loop.streams.cut(lambda request_id: DrainTimeout(
        f"the scheduler shut down before request {request_id!r} finished (its drain timeout of "
        f"{drain_timeout_s:g}s passed)"))
