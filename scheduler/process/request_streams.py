"""Each live request's stream in the scheduler process: the queue its Submit call reads, its timings,
its deadline, and the sinks its transitions go to (request records and, for resumable requests,
token streams in Redis). The step loop opens a stream on submit and hands it every delta; the last
one ends it. Sinks never block: their writers batch to Redis off the loop (invariant 6).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Protocol

from core.errors import ServingError
from core.outputs import FinishReason, RequestOutput, coalesce
from core.step import StepPlan
from scheduler.process.delta_streams import DeltaStream, DeltaStreams
from scheduler.request import Request

logger = logging.getLogger(__name__)

# A running request's record gets its output token count at least this often (and its first-token
# time at once), batched like every other record change (invariant 6).
PROGRESS_INTERVAL_S = 0.5
PROGRESS_INTERVAL_TOKENS = 16
# How long a stream's first and last message wait for the record to say what they say (QUEUED or
# later; the end state). Only while Redis answers: a failing Redis is not waited for at all.
RECORD_WAIT_S = 0.5
# how long a resumable request's first output waits for its submission to reach Redis (the live writer
# flushes every 10 ms; past this Redis is taken to be away and the output goes out unkept, with a warning)
KEPT_WAIT_S = 0.5


class StateSink(Protocol):
    """What the loop reports request transitions to (kvstore.RequestStateWriter in production)."""

    def queued(self, request_id: str, *, num_prompt_tokens: int | None = None, model: str | None = None,
               priority: int | None = None, created_at: float | None = None, owner: str | None = None) -> None: ...
    def running(self, request_id: str) -> None: ...
    def preempted(self, request_id: str) -> None: ...
    def progress(self, request_id: str, *, num_output_tokens: int, at: float | None = None) -> None: ...
    def finished(self, request_id: str, *, finish_reason: FinishReason = FinishReason.STOP,
                 num_output_tokens: int | None = None) -> None: ...
    def failed(self, request_id: str, *, error: ServingError, num_output_tokens: int | None = None) -> None: ...
    def cancelled(self, request_id: str, *, num_output_tokens: int | None = None) -> None: ...
    async def written(self, request_id: str, timeout_s: float) -> bool: ...


class TokenSink(Protocol):
    """Where resumable requests' tokens go (kvstore.TokenStreamWriter in production)."""

    def append(self, request_id: str, start_index: int, token_ids: list[int]) -> None: ...
    def finish(self, request_id: str, end_index: int, finish_reason: FinishReason, error: ServingError | None,
               num_prompt_tokens: int) -> None: ...


@dataclass(slots=True)
class RequestTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    first_token_forward_ns: int = 0  # the worker's time for the step that produced it
    finished: float | None = None


@dataclass(slots=True)
class RequestStream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    times: RequestTimes = field(default_factory=RequestTimes)
    num_output_tokens_recorded: int = 0  # the count last sent to the record
    progress_recorded_at: float = 0.0  # monotonic time of that
    # the reason an Abort call asked for (a stop string the gateway matched, a CancelRequest), until the
    # loop ends the request with it: how it ended if its Submit call is dropped in the meantime
    abort_reason: FinishReason | None = None
    # its gateway's StreamDeltas call, which carries its deltas after the first (scheduler.process.delta_streams)
    delta_stream: DeltaStream | None = None
    started: bool = False  # a delta went to its own queue: the first message, which the Submit call sends
    # a resumable request without a Submit call (its gateway went away, or it was re-admitted after a
    # restart): monotonic time since when; scheduler.process.orphans aborts it if nobody follows it from Redis
    detached_since: float | None = None
    # a resumable request's submission on its way to Redis (scheduler.process.readmission): until it is kept
    # there its outputs are held (held, coalesced), so no client sees a token of a request a restarted
    # scheduler would not re-admit; None once kept (or for a request that needs no keeping)
    kept: asyncio.Future | None = None
    held: RequestOutput | None = None
    held_forward_ns: int = 0


class RequestStreams:
    def __init__(self, state: StateSink | None = None, tokens: TokenSink | None = None, model_name: str = "") -> None:
        self.state = state
        self.tokens = tokens
        self.model_name = model_name  # recorded with each request
        self._streams: dict[str, RequestStream] = {}
        self._deadlines: dict[str, float] = {}  # request id -> wall-clock deadline
        self._resumable: set[str] = set()  # ids whose tokens go to `tokens`, to outlive their caller
        self.delta_streams = DeltaStreams()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request: Request, deadline: float | None, resumable: bool, owner: str | None,
             delta_stream_id: str = "", kept: asyncio.Future | None = None) -> RequestStream:
        """deadline: wall-clock Unix seconds; resumable: its tokens also go to the token sink (if any);
        owner: the API key name that submitted it, recorded for the gateways' by-id checks;
        delta_stream_id: its gateway's open delta stream, if any (an unknown id: none)."""
        request_id = request.request_id
        stream = self._streams[request_id] = RequestStream(delta_stream=self.delta_streams.get(delta_stream_id),
                                                           kept=kept)
        if deadline is not None:
            self._deadlines[request_id] = deadline
        if resumable and self.tokens is not None:
            self._resumable.add(request_id)
        if self.state:
            self.state.queued(request_id, num_prompt_tokens=request.num_prompt_tokens, model=self.model_name,
                              priority=request.priority, created_at=time.time(), owner=owner)
        return stream

    def detach(self, request_id: str, since: float | None = None) -> None:
        """The request runs on without a Submit call (since: monotonic time; None: now)."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.detached_since = time.monotonic() if since is None else since

    def detached(self) -> dict[str, float]:
        """Request id -> since when it runs without a Submit call, for each such request not being aborted."""
        return {request_id: stream.detached_since for request_id, stream in self._streams.items()
                if stream.detached_since is not None and stream.abort_reason is None}

    def abort_requested(self, request_id: str, reason: FinishReason) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and stream.abort_reason is None:
            stream.abort_reason = reason

    def past_deadline(self) -> list[str]:
        """Ids whose deadline has passed (they stay open until ended)."""
        if not self._deadlines:
            return []
        now = time.time()
        return [request_id for request_id, deadline in self._deadlines.items() if deadline <= now]

    def scheduled(self, plan: StepPlan, live_request_ids: Container[str]) -> None:
        """A plan is being sent. live_request_ids: the scheduler's requests (one the plan drops from
        the worker while it lives was preempted)."""
        now = time.monotonic()
        self.preempted([rid for rid in plan.finished_request_ids if rid in live_request_ids])
        for new in plan.new_requests:
            stream = self._streams.get(new.request_id)
            if stream and stream.times.first_scheduled is None:
                stream.times.first_scheduled = now
            if self.state:
                self.state.running(new.request_id)

    def preempted(self, request_ids: list[str]) -> None:
        if self.state:
            for request_id in request_ids:
                self.state.preempted(request_id)

    def deliver(self, outputs: list[RequestOutput], forward_ns: int) -> None:
        """One step's deltas; forward_ns: the worker's time for that step."""
        now = time.monotonic()
        batched: list[DeltaStream] = []
        streams, state, resumable = self._streams, self.state, self._resumable  # every step, every request: locals
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is None:
                continue
            if stream.kept is not None and self._hold(stream, output, forward_ns):
                continue
            if stream.times.first_token is None and output.new_token_ids:
                stream.times.first_token = now
                stream.times.first_token_forward_ns = forward_ns
            if state:
                self._record_progress(stream, output, now)
            if output.finished:
                self.end(output)
                continue
            if output.request_id in resumable:
                self._write_tokens(output)
            delta_stream = stream.delta_stream
            if stream.started and delta_stream is not None and not delta_stream.closed:
                if delta_stream.add(output):
                    batched.append(delta_stream)
            else:
                stream.started = True
                stream.queue.put_nowait(output)
        for delta_stream in batched:  # one message per gateway for the whole step
            delta_stream.flush()

    def _record_progress(self, stream: RequestStream, output: RequestOutput, now: float) -> None:
        """The first token at once (its time is first_token_at), then every PROGRESS_INTERVAL_TOKENS
        tokens or PROGRESS_INTERVAL_S seconds, whichever comes first."""
        count = output.num_output_tokens
        recorded = stream.num_output_tokens_recorded
        if count <= recorded:
            return
        if (recorded and count - recorded < PROGRESS_INTERVAL_TOKENS
                and now - stream.progress_recorded_at < PROGRESS_INTERVAL_S):
            return
        stream.num_output_tokens_recorded, stream.progress_recorded_at = count, now
        first_token = stream.times.first_token
        first_token_at = None if first_token is None else time.time() - (now - first_token)  # wall clock
        self.state.progress(output.request_id, num_output_tokens=count, at=first_token_at)

    async def recorded(self, request_id: str) -> None:
        """Returns once the request's record holds every change so far, or after RECORD_WAIT_S, or at
        once without a state sink or while Redis is failing (the caller's message must not wait on it)."""
        if self.state is not None:
            await self.state.written(request_id, RECORD_WAIT_S)

    def end(self, output: RequestOutput) -> None:
        """Hands a request's last output to its stream and records how it ended."""
        stream = self._streams.pop(output.request_id, None)
        self._deadlines.pop(output.request_id, None)
        if stream is None:
            return
        if stream.held is not None:  # ended while its submission was still on its way: what it held goes too
            output = coalesce(stream.held, output)
            stream.held = stream.kept = None
        stream.times.finished = time.monotonic()
        stream.queue.put_nowait(output)
        if output.request_id in self._resumable:
            self._resumable.discard(output.request_id)
            self._write_tokens(output)
        if not self.state:
            return
        # cancelled and failed records keep the true count: tokens generated before the ending
        if output.error is not None:
            self.state.failed(output.request_id, error=output.error, num_output_tokens=output.num_output_tokens)
        elif output.finish_reason is FinishReason.ABORT:
            self.state.cancelled(output.request_id, num_output_tokens=output.num_output_tokens)
        else:
            self.state.finished(output.request_id, finish_reason=output.finish_reason or FinishReason.STOP,
                                num_output_tokens=output.num_output_tokens)

    def cut(self, error_for: Callable[[str], ServingError]) -> None:
        """Ends the call of every open stream with error_for(request_id), leaving the requests themselves
        as they are (records, pages, resumable tokens): the process is stopping (scheduler.process.service.drain)."""
        for request_id, stream in self._streams.items():
            stream.queue.put_nowait(RequestOutput(request_id, finished=True, finish_reason=FinishReason.ERROR,
                                                  error=error_for(request_id)))

    def _hold(self, stream: RequestStream, output: RequestOutput, forward_ns: int) -> bool:
        """Whether output waits for the stream's submission to be kept; the first one held arranges the
        release: when it is kept, or after KEPT_WAIT_S at the most (Redis away degrades, never blocks)."""
        if stream.kept.done():  # kept, its release callback not run yet (a loop turn later): it goes first
            self._release(stream)
            return False
        if stream.held is None:
            stream.held, stream.held_forward_ns = output, forward_ns
            stream.kept.add_done_callback(lambda _: self._release(stream))
            asyncio.get_running_loop().call_later(KEPT_WAIT_S, self._release, stream)
        else:
            stream.held = coalesce(stream.held, output)
        return True

    def _release(self, stream: RequestStream) -> None:
        if stream.kept is None:
            return  # released already, or ended
        if not stream.kept.done():
            logger.warning("request %r: its submission is not in Redis after %gs; its tokens go out without it "
                           "(a scheduler restart now would not re-admit it)", stream.held.request_id, KEPT_WAIT_S)
        held, stream.held, stream.kept = stream.held, None, None
        if held is not None and self._streams.get(held.request_id) is stream:
            self.deliver([held], stream.held_forward_ns)

    def _write_tokens(self, output: RequestOutput) -> None:
        end = output.num_output_tokens
        if output.new_token_ids:
            self.tokens.append(output.request_id, end - len(output.new_token_ids), output.new_token_ids)
        if output.finished:
            self.tokens.finish(output.request_id, end, output.finish_reason or FinishReason.ERROR, output.error,
                               output.num_prompt_tokens)
