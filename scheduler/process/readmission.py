"""A restarted scheduler takes up the resumable requests it was running when it died.

While a resumable request lives, what was submitted for it is kept in Redis
(kvstore.live_requests, one hash per scheduler, named by its advertised address) and its tokens go
to its token stream. After a crash (kill -9, OOM) the supervisor starts the scheduler again under
the same address; before it reports ready, readmit() submits each such request again with the
tokens already streamed appended to its prompt's output, the way a preempted request is recomputed
(DESIGN invariant 2): the worker recomputes prompt + those tokens, and generation continues at the
next index of the same token stream. Greedy output is therefore the one an undisturbed run gives,
and a client resuming by id (gateway.generation.resume) gets the rest with no token lost or repeated. Requests
nobody resumes run to their end; their record, token stream and claim expire with their TTL.

    tokens = ReadmittableTokens(token_writer, live_writer)    # the loop's TokenSink
    loop = EngineLoop(..., tokens=tokens, live=tokens)
    await readmit(loop, LiveRequestReader(redis_url, scheduler_id))
"""
from __future__ import annotations

import asyncio
import base64
import logging

from google.protobuf.message import DecodeError
from redis.exceptions import RedisError

from core.errors import ServingError
from core.outputs import FinishReason
from core.requests import GenerationRequest
from kvstore.live_requests import LiveRequestReader, LiveRequestWriter
from protos import codec
from protos.tokenmill.v1 import scheduler_pb2
from scheduler.process.loop import EngineLoop
from scheduler.process.request_streams import TokenSink
from scheduler.request import Request

logger = logging.getLogger(__name__)
_READ_TIMEOUT_S = 10.0  # start-up waits this long for Redis at most (a missing Redis degrades, never blocks)


class ReadmittableTokens:
    """The loop's TokenSink: tokens go to the token stream writer as before, and a request's
    submission is kept (admitted) until its stream is finished (ended)."""

    def __init__(self, tokens: TokenSink, live: LiveRequestWriter) -> None:
        self._tokens = tokens
        self._live = live
        self.append = tokens.append  # every token of every step: the writer's own method, not a call through this one

    def admitted(self, request: Request, deadline: float | None, owner: str | None) -> asyncio.Future:
        """Done once the submission is in Redis (LiveRequestWriter.admitted)."""
        spec = GenerationRequest(request.request_id, list(request.prompt_token_ids), request.sampling_params,
                                 eos_token_id=request.eos_token_id, priority=request.priority,
                                 target_itl_ms=request.target_itl_ms, target_ttft_ms=request.target_ttft_ms)
        message = codec.submit_request_to_proto(spec, deadline, resumable=True, owner=owner)
        return self._live.admitted(request.request_id, base64.b64encode(message.SerializeToString()).decode())

    def finish(self, request_id: str, end_index: int, finish_reason: FinishReason, error: ServingError | None,
               num_prompt_tokens: int) -> None:
        self._tokens.finish(request_id, end_index, finish_reason, error, num_prompt_tokens)
        self._live.ended(request_id)


async def readmit(loop: EngineLoop, reader: LiveRequestReader) -> int:
    """Submits again the requests this scheduler had not ended; returns how many. loop: the EngineLoop
    (started, its tokens a ReadmittableTokens)."""
    try:
        async with asyncio.timeout(_READ_TIMEOUT_S):
            live = await reader.live()
            streamed = {request_id: await reader.streamed(request_id) for request_id in live}
    except (RedisError, OSError, TimeoutError) as error:
        logger.error("cannot read the requests this scheduler ran before it restarted (Redis: %r); "
                     "they are not re-admitted and their records expire with their TTL", error)
        return 0
    readmitted = 0
    for request_id, submitted in live.items():
        token_ids, finish_reason = streamed[request_id]
        if finish_reason is not None:  # it ended; only the clean-up was lost
            await _forget(reader, request_id)
            continue
        try:
            message = scheduler_pb2.SubmitRequest.FromString(base64.b64decode(submitted, validate=True))
        except (ValueError, DecodeError) as error:
            logger.error("request %r cannot be re-admitted: its stored submission is unreadable (%s)", request_id, error)
            await _forget(reader, request_id)
            continue
        request = Request.from_generation_request(codec.generation_request_from_submit_proto(message))
        request.all_token_ids += token_ids
        if (reason := _ended_by(request)) is not None:  # it died between its last token and its finish entry
            _end(loop, request, reason, None)
            continue
        try:
            loop.submit(request, codec.deadline_from_submit_proto(message), resumable=True,
                        owner=message.owner or None)
        except ServingError as error:  # e.g. a smaller queue bound than before the restart
            _end(loop, request, FinishReason.ERROR, error)
            continue
        loop.streams.detach(request_id)  # no call: its clients follow it from Redis (scheduler.process.orphans)
        readmitted += 1
    if live:
        logger.warning("re-admitted %d of %d requests this scheduler was running before it restarted "
                       "(recomputed from their streamed tokens)", readmitted, len(live))
    return readmitted


def _ended_by(request: Request) -> FinishReason | None:
    params = request.sampling_params
    if request.num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    last = request.output_token_ids[-1] if request.num_output_tokens else None
    if last is not None and (last in params.stop_token_ids or (last == request.eos_token_id and not params.ignore_eos)):
        return FinishReason.STOP
    return None


def _end(loop: EngineLoop, request: Request, reason: FinishReason, error: ServingError | None) -> None:
    """Writes the ending of a request that is not run again: its stream's finish entry and its record."""
    loop.tokens.finish(request.request_id, request.num_output_tokens, reason, error, request.num_prompt_tokens)
    state = loop.streams.state
    if state is None:
        return
    if error is not None:
        state.failed(request.request_id, error=error)
    else:
        state.finished(request.request_id, finish_reason=reason, num_output_tokens=request.num_output_tokens)


async def _forget(reader: LiveRequestReader, request_id: str) -> None:
    try:
        await reader.forget(request_id)
    except (RedisError, OSError, TimeoutError) as error:
        logger.warning("could not forget request %r (Redis: %r); it expires with the TTL", request_id, error)
