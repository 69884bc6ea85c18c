"""One prepared request through the scheduler as text deltas: the path every public API shares
(tokenmill.v1 gRPC, OpenAI-compatible HTTP, KServe v2), each converting GenerationDelta to its own wire.

    deltas = stream_generation(prepared, tokenizer, scheduler, timeout_s=None)
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

from core.errors import Cancelled, DeadlineExceeded, ServingError, Unavailable
from core.outputs import FinishReason, RequestOutput, RequestTimings
from core.step import TokenLogprobs
from gateway.prepare.request_builder import PreparedRequest
from gateway.upstream.scheduler_client import SchedulerClient
from gateway.telemetry import DEADLINE, DRAINED, RequestObserver
from gateway.text.text_stream import TextStream
from gateway.text.tokenizer import TextTokenizer

# A call cut this close to its deadline was cut by it (gRPC's deadline and ours are read from two
# clocks a moment apart); a client that left within this margin of its deadline counts as timed out
DEADLINE_SLACK_S = 0.05


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


async def stream_generation(prepared: PreparedRequest, tokenizer: TextTokenizer, scheduler: SchedulerClient,
                            timeout_s: float | None = None, arrival: float | None = None,
                            resumable: bool = False, owner: str | None = None,
                            deadline_unix_s: float | None = None, target=None,
                            counts_prompt: bool = True,
                            observer: RequestObserver | None = None) -> AsyncIterator[GenerationDelta]:
    """timeout_s: the client's time left (None: no deadline), read with nothing awaited since;
    deadline_unix_s instead: the deadline itself (Unix seconds), from a caller that awaited something
    after reading it (gateway.generation.resume asks Redis first), for the time left counts from that read.
    arrival: time.monotonic() when the request reached the gateway (default: now), for the timings.
    owner: the API key name that sent it (gateway.generation.ownership), recorded with the request.
    target: a replica already chosen by scheduler.route() (the samples of one prompt go to one replica,
    whose prefix cache they share); None: routed here.
    counts_prompt: False for the samples of an n > 1 request but the first (RequestObserver).
    resumable: the scheduler keeps the request running if this gateway dies (see gateway.generation.resume),
    so a client's cancel is sent as an explicit Abort.
    observer: the caller's RequestObserver (None: one made here). Given, an UNAVAILABLE is left to the
    caller to record: it may follow the request on from Redis (gateway.generation.resume) rather than end it.

    Raises Unavailable when the scheduler cannot be reached; the scheduler's other refusals and
    failures come through as the core.errors type it sent (InvalidArgument, DeadlineExceeded, ...)."""
    arrival = time.monotonic() if arrival is None else arrival
    request_id = prepared.request.request_id
    text_stream = TextStream(tokenizer, prepared.request.prompt_token_ids, prepared.stop)
    # The client's deadline travels twice: as the call's gRPC timeout, and in the request, so the
    # scheduler ends the request (and frees its pages) itself when it passes.
    deadline = deadline_unix_s
    if deadline is None and timeout_s is not None:
        deadline = time.time() + timeout_s
    ends_unavailable = observer is None  # else the caller records an UNAVAILABLE ending (it may go on)
    if observer is None:  # GenAI span attributes, latency metrics
        observer = RequestObserver(prepared.request, arrival, counts_prompt)
    try:
        if target is None:  # Unavailable when no scheduler can take it
            target = scheduler.route(prepared.request.prompt_token_ids)
        breaker = target.breaker
        probe = breaker.before_call()  # UNAVAILABLE at once while the scheduler is known to be down
    except ServingError as error:
        if ends_unavailable or not isinstance(error, Unavailable):
            observer.on_error(error)
        raise
    outputs = target.submit(prepared.request, deadline_unix_s=deadline, resumable=resumable, owner=owner,
                            timeout_s=None if deadline is None else max(deadline - time.time(), 0.0))
    first_token = None
    finished = answered = False
    prompt_logprobs_due = prepared.request.sampling_params.prompt_logprobs is not None
    try:
        async with contextlib.aclosing(outputs):  # leaving early cancels the call: the scheduler frees the pages
            async for output in outputs:
                if not answered:
                    answered = True
                    breaker.record_success()
                token_ids = output.new_token_ids
                if token_ids and first_token is None:
                    first_token = time.monotonic()
                observer.on_tokens(len(token_ids))
                delta = GenerationDelta(request_id, text_stream.push(token_ids), token_ids,
                                        _logprobs(tokenizer, token_ids, output.logprobs))
                if prompt_logprobs_due and token_ids:  # a one-token prompt's (no entries) arrive as None
                    prompt_logprobs_due = False
                    delta.prompt_logprobs = _logprobs(tokenizer, prepared.request.prompt_token_ids[1:],
                                                      output.prompt_logprobs or [])
                if text_stream.stopped or output.finished:
                    finished = True
                    if text_stream.stopped and not output.finished:
                        await scheduler.abort([request_id], FinishReason.STOP)
                    delta.text += text_stream.finish()
                    delta.finish = _finish(output, text_stream, arrival, first_token)
                    observer.on_finish(delta.finish)
                    yield delta
                    return
                yield delta
    except Unavailable as error:
        finished = True  # the call ended with a status: nothing to abort
        if ends_unavailable:
            observer.on_error(error)
        breaker.record_failure()
        # the scheduler (or its worker) is gone: the record must not stay "running" in Redis, unless the
        # request is resumable, which the restarted scheduler re-admits (scheduler.process.readmission)
        if not resumable:
            scheduler.report_lost(request_id, Unavailable(f"scheduler unavailable: {error}"), accepted=answered)
        raise Unavailable(f"scheduler at {target.address} is unavailable: {error}") from error
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
            _record_cut(observer, scheduler, deadline)
        if not finished and resumable:  # the client went away: a resumable request is aborted explicitly
            scheduler.abort_in_background(request_id)


def _record_cut(observer: RequestObserver, scheduler: SchedulerClient, deadline: float | None) -> None:
    if deadline is not None and time.time() >= deadline - DEADLINE_SLACK_S:
        observer.on_cut(DeadlineExceeded(f"request {observer.request_id!r} passed its deadline after "
                                         f"{observer.num_tokens} tokens"), DEADLINE)
    elif scheduler.shutting_down:  # set before the server stops: what it cuts now is the drain's doing
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
