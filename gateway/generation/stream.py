"""One prepared request through the scheduler as text deltas, and the delta every route yields (each API
converts GenerationDelta to its own wire). The plain route (no Redis); every other route runs on it: the
samples of an n > 1 request (gateway.generation.samples), a resumable request (gateway.generation.resume).

    deltas = stream_generation(prepared, call, side)     # gateway.generation.context; the APIs call
                                                         # Generations.stream, which chooses this route
    async with contextlib.aclosing(deltas):
        async for delta in deltas:        # text, token_ids, logprobs; .finish is set on the last one
            ...

Leaving early (break, an exception, the task being cancelled because the client went away) cancels
the scheduler call, which aborts the request and frees its KV pages. A stop string matched here ends
the request in the scheduler as finished with reason stop.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import NoReturn

from core.errors import Cancelled, DeadlineExceeded, ServingError, Unavailable
from core.outputs import FinishReason, RequestOutput, RequestTimings, coalesce
from core.step import TokenLogprobs
from gateway.prepare.request_builder import PreparedRequest
from gateway.generation.context import CallContext, SchedulerSide
from gateway.upstream.target import Route
from gateway.telemetry import DEADLINE, DRAINED, RequestObserver, ToolCallsSeen
from gateway.text.text_stream import TextStream
from gateway.text.tokenizer import TextTokenizer

# A call cut this close to its deadline was cut by it (gRPC's deadline and ours are read from two
# clocks a moment apart); a client that left within this margin of its deadline counts as timed out
DEADLINE_SLACK_S = 0.05


class TokensOutOfSequence(Unavailable):
    """A request's outputs skipped or repeated tokens (a fault in the scheduler's delivery, which a resumable
    request's Redis token stream may still make good): the stream ends rather than hand on a gap."""


@dataclass(slots=True)
class TopLogprob:
    token_id: int
    token: str  # its own text; a partial UTF-8 sequence shows as replacement characters
    logprob: float


@dataclass(slots=True)
class TokenLogprob:
    """The chosen token at one position and the most likely alternatives, best first."""

    token_id: int
    token: str
    logprob: float  # under the model's raw distribution (before temperature and truncation)
    top: list[TopLogprob] = field(default_factory=list)


@dataclass(slots=True)
class Finish:
    """What the last delta of a request carries."""

    reason: FinishReason  # the public APIs write its .value ("stop", "length", "abort", "error")
    matched_stop: str  # the stop string that ended generation, "" if none did
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    queue_ns: int  # from the scheduler
    time_to_first_token_ns: int  # the rest measured here, from arrival
    decode_ns: int
    e2e_ns: int
    first_token_forward_ns: int = 0  # the worker's time for the step that produced the first token


@dataclass(slots=True)
class GenerationDelta:
    request_id: str
    text: str  # safe to show: may be "" while a character is incomplete or a stop string may start
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # one per token id when the request asked for logprobs, else empty
    finish: Finish | None = None
    # SamplingParams.prompt_logprobs: on the first delta with token ids, one per prompt token after the
    # first (token_id is that prompt token); None on every other delta and when the request did not ask
    prompt_logprobs: list[TokenLogprob] | None = None
    index: int = 0  # which of a request's samples (n > 1: gateway.generation.samples) this delta belongs to


async def every_interval(outputs: AsyncIterator[RequestOutput], interval: int) -> AsyncIterator[RequestOutput]:
    """outputs as a stream sends them with --stream-interval (vLLM's and SGLang's): everything up to and with
    the first token at once (the time to first token is not delayed), then one output each time interval
    tokens have come, and the finished one. Fewer messages mean less of the gRPC and HTTP cost per token, which is per message.
    What is held back when outputs fail was never sent, so a resumed stream gets it again (its index)."""
    held: RequestOutput | None = None
    sent = 0  # tokens yielded: until the first one, nothing waits (an output without tokens neither)
    async with contextlib.aclosing(outputs):
        async for output in outputs:
            held = output if held is None else coalesce(held, output)
            if not sent or held.finished or len(held.new_token_ids) >= interval:
                sent += len(held.new_token_ids)
                output, held = held, None
                yield output


async def stream_generation(prepared: PreparedRequest, call: CallContext, side: SchedulerSide, *,
                            target: Route | None = None, observer: RequestObserver | None = None,
                            resumable: bool = False) -> AsyncIterator[GenerationDelta]:
    """call: the client's deadline, arrival, owner. side: the tokenizer and the scheduler target.
    target: a scheduler already chosen by side.scheduler.route() (the samples of one prompt go to one
    replica, whose prefix cache they share); None: routed here.
    observer: the caller's RequestObserver (None: one made here, for a request counting its prompt).
    resumable: the scheduler keeps the request running if this gateway dies (see gateway.generation.resume),
    so a client's cancel is sent as an explicit Abort, and an UNAVAILABLE is left to the caller to record:
    it may follow the request on from Redis rather than end it.

    Raises Unavailable when the scheduler cannot be reached; the scheduler's other refusals and
    failures come through as the core.errors type it sent (InvalidArgument, DeadlineExceeded, ...)."""
    request_id = prepared.request.request_id
    if observer is None:  # GenAI span attributes, latency metrics
        observer = RequestObserver(prepared.request, call.arrival)
    target, probe = _admit(prepared, side, target, observer, records_unavailable=not resumable)
    breaker = target.breaker
    outputs = target.submit(prepared.request, deadline_unix_s=call.deadline_unix_s, resumable=resumable,
                            owner=call.owner, timeout_s=call.time_left())
    deltas = _Deltas(prepared, side.tokenizer, call.arrival)
    finished = answered = False
    try:
        # leaving early cancels the call: the scheduler frees the pages
        async with contextlib.aclosing(every_interval(outputs, side.stream_interval)) as outputs:
            async for output in outputs:
                if not answered:
                    answered = True
                    breaker.record_success()
                observer.on_tokens(len(output.new_token_ids))
                delta = deltas.of(output)
                if deltas.text_stream.stopped or output.finished:
                    finished = True
                    if deltas.text_stream.stopped and not output.finished:
                        await side.scheduler.abort([request_id], FinishReason.STOP)
                    deltas.finish(delta, output)
                    observer.on_finish(delta.finish, deltas.tool_calls())
                    yield delta
                    return
                yield delta
    except Unavailable as error:
        finished = True  # the call ended with a status: nothing to abort
        _scheduler_gone(error, side, target, observer, resumable=resumable, answered=answered)
    except ServingError as error:
        finished = True
        observer.on_error(error)
        if not answered and not isinstance(error, Cancelled):
            breaker.record_success()  # it answered, with a refusal: it is up
        raise
    finally:
        if probe:
            breaker.release_probe()  # a no-op once the probe's outcome was recorded
        if not finished:  # the call was cut: by its deadline, by this gateway's shutdown or by the client
            _record_cut(observer, side, call.deadline_unix_s)
        if not finished and resumable:  # the client went away: a resumable request is aborted explicitly
            side.abort_in_background(request_id)


def _admit(prepared: PreparedRequest, side: SchedulerSide, target: Route | None, observer: RequestObserver,
           records_unavailable: bool) -> tuple[Route, bool]:
    """The call's scheduler and whether this call is its breaker's half-open probe; Unavailable at once
    when no scheduler can take it, or while the one chosen is known to be down (its breaker open)."""
    try:
        if target is None:
            target = side.scheduler.route(prepared.request.prompt_token_ids)
        return target, target.breaker.before_call()
    except ServingError as error:
        if records_unavailable or not isinstance(error, Unavailable):
            observer.on_error(error)
        raise


def _scheduler_gone(error: Unavailable, side: SchedulerSide, target: Route, observer: RequestObserver, *,
                    resumable: bool, answered: bool) -> NoReturn:
    out_of_sequence = isinstance(error, TokensOutOfSequence)  # one request's outputs: the scheduler is not away
    if not out_of_sequence:
        target.breaker.record_failure()
    if not resumable:
        observer.on_error(error)
        # the scheduler (or its worker) is gone: the record must not stay "running" in Redis, unless the
        # request is resumable, which the restarted scheduler re-admits (scheduler.process.readmission)
        lost = error if out_of_sequence else Unavailable(f"scheduler unavailable: {error}")
        side.report_lost(observer.request_id, lost, accepted=answered)
    if out_of_sequence:
        raise error
    raise Unavailable(f"scheduler at {target.address} is unavailable: {error}") from error


class _Deltas:
    """A request's outputs as deltas: text (stop strings matched), logprobs, prompt logprobs once, the finish."""

    def __init__(self, prepared: PreparedRequest, tokenizer: TextTokenizer, arrival: float) -> None:
        self.prepared, self.tokenizer, self.arrival = prepared, tokenizer, arrival
        self.text_stream = TextStream(tokenizer, prepared.request.prompt_token_ids, prepared.stop)
        self.first_token: float | None = None
        self.num_tokens = 0  # output tokens received so far
        self.prompt_logprobs_due = prepared.request.sampling_params.prompt_logprobs is not None
        # a tools chat's text, parsed for its calls when it ends (the span, metrics and log line say tool_calls)
        self.text: list[str] | None = [] if prepared.tool_syntax is not None else None

    def of(self, output: RequestOutput) -> GenerationDelta:
        token_ids = output.new_token_ids
        if token_ids:  # outputs cover [num_output_tokens - len(new_token_ids), num_output_tokens), one after another
            start = output.num_output_tokens - len(token_ids)
            if start != self.num_tokens:  # a client must never get a stream with tokens missing or twice
                raise TokensOutOfSequence(f"request {output.request_id!r}: the scheduler sent tokens from index "
                                          f"{start} after {self.num_tokens} tokens; retry")
            self.num_tokens = output.num_output_tokens
        if token_ids and self.first_token is None:
            self.first_token = time.monotonic()
        delta = GenerationDelta(self.prepared.request.request_id, self.text_stream.push(token_ids), token_ids,
                                _logprobs(self.tokenizer, token_ids, output.logprobs))
        if self.text is not None:
            self.text.append(delta.text)
        if self.prompt_logprobs_due and token_ids:  # a one-token prompt's (no entries) arrive as None
            self.prompt_logprobs_due = False
            delta.prompt_logprobs = _logprobs(self.tokenizer, self.prepared.request.prompt_token_ids[1:],
                                              output.prompt_logprobs or [])
        return delta

    def finish(self, delta: GenerationDelta, output: RequestOutput) -> None:
        rest = self.text_stream.finish()
        delta.text += rest
        if self.text is not None:
            self.text.append(rest)
        delta.finish = _finish(output, self.text_stream, self.arrival, self.first_token)

    def tool_calls(self) -> ToolCallsSeen | None:
        """A tools chat's whole output, parsed as the OpenAI API will answer it (None: not a tools chat)."""
        return None if self.text is None else tool_calls_seen(self.prepared, "".join(self.text))


def tool_calls_seen(prepared: PreparedRequest, text: str) -> ToolCallsSeen | None:
    """What a tools chat's whole output calls, parsed as the OpenAI API will answer it (None: not a tools chat)."""
    syntax = prepared.tool_syntax
    if syntax is None:
        return None
    parsed = syntax.parse(text)
    return ToolCallsSeen([call.name for call in parsed.tool_calls], syntax.call_failed(parsed))


def _record_cut(observer: RequestObserver, side: SchedulerSide, deadline: float | None) -> None:
    if deadline is not None and time.time() >= deadline - DEADLINE_SLACK_S:
        observer.on_cut(DeadlineExceeded(f"request {observer.request_id!r} passed its deadline after "
                                         f"{observer.num_tokens} tokens"), DEADLINE)
    elif side.shutting_down:  # set before the server stops: what it cuts now is the drain's doing
        observer.on_cut(Unavailable(f"the gateway shut down before request {observer.request_id!r} finished "
                                    "(its drain timeout passed)"), DRAINED)
    else:  # the client went away (cancelled the call, closed the connection)
        observer.on_disconnect()


def _logprobs(tokenizer: TextTokenizer, token_ids: list[int], entries: list[TokenLogprobs]) -> list[TokenLogprob]:
    return [TokenLogprob(token_id, tokenizer.decode([token_id], False), entry.logprob,
                         [TopLogprob(top_id, tokenizer.decode([top_id], False), top_logprob)
                          for top_id, top_logprob in entry.top])
            for token_id, entry in zip(token_ids, entries)]


def _finish(output: RequestOutput, text_stream: TextStream, arrival: float, first_token: float | None) -> Finish:
    now = time.monotonic()
    timings = output.timings or RequestTimings()
    reason = FinishReason.STOP if text_stream.stopped else output.finish_reason
    return Finish(reason=reason or FinishReason.ERROR, matched_stop=text_stream.matched_stop,
                  prompt_tokens=output.num_prompt_tokens, completion_tokens=output.num_output_tokens,
                  cached_prompt_tokens=output.num_cached_tokens, queue_ns=timings.queue_ns,
                  time_to_first_token_ns=int(((first_token or now) - arrival) * 1e9),
                  decode_ns=int((now - (first_token or now)) * 1e9), e2e_ns=int((now - arrival) * 1e9),
                  first_token_forward_ns=timings.first_token_forward_ns)
