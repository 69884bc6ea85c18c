"""Attaching to a request that is already running (or done) instead of running it again: the client
resumes its stream after its gateway died, or sent the same request_id twice.

    deltas = attach_generation(prepared, tokenizer, token_reader, state_reader, from_index=17)

The tokens come from the request's Redis token stream (kvstore.token_streams), which the scheduler
writes for resumable requests whatever happens to the gateway that submitted them. The prepared
request (the same request sent again) gives the prompt for detokenization and the stop strings; the
text of the tokens before from_index is decoded but not sent, so the text resumes where it broke off.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from gateway.generation_stream import Finish, GenerationDelta, stream_generation
from gateway.id_claims import claimed_generation
from gateway.ownership import RequestOwners
from gateway.request_builder import PreparedRequest
from gateway.scheduler_client import SchedulerClient
from gateway.text_stream import TextStream
from gateway.tokenizer import TextTokenizer
from kvstore.request_claims import RequestClaims, request_fingerprint
from kvstore.state_reader import RequestStateReader
from kvstore.token_streams import TokenEntry, TokenStreamReader
from core.errors import AlreadyExists, DeadlineExceeded, NotFound, Unavailable
from core.outputs import FinishReason

logger = logging.getLogger(__name__)

# A record that is terminal while its token stream says nothing more for this long was lost with its
# scheduler (the final entry is written after the record only by a few milliseconds).
_LOST_AFTER_S = 3.0
_KNOWN_CHECK_TIMEOUT_S = 0.5


async def attach_generation(prepared: PreparedRequest, tokenizer: TextTokenizer, tokens: TokenStreamReader,
                            records: RequestStateReader | None, from_index: int = 0,
                            timeout_s: float | None = None, on_quiet=None) -> AsyncIterator[GenerationDelta]:
    """on_quiet: awaited about once a second while the stream is still empty (gateway.id_claims checks
    that the request it waits for is still coming)."""
    request_id = prepared.request.request_id
    text_stream = TextStream(tokenizer, prepared.request.prompt_token_ids, prepared.stop)
    arrival = time.monotonic()
    deadline = arrival + timeout_s if timeout_s is not None else None
    after, next_index, quiet_since = "0", 0, time.monotonic()
    while True:
        after, entries = await tokens.read(request_id, after, block_ms=1000)
        if not entries:
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlineExceeded(f"request {request_id!r}: deadline passed while attached to its stream")
            if on_quiet is not None and after == "0":
                await on_quiet()
            if time.monotonic() - quiet_since > _LOST_AFTER_S:
                await _raise_if_lost(records, request_id)
            continue
        quiet_since = time.monotonic()
        for entry in entries:
            token_ids = entry.token_ids[max(next_index - entry.index, 0):]  # a resent entry repeats
            next_index = max(next_index, entry.index + len(entry.token_ids))
            start = next_index - len(token_ids)
            skipped = token_ids[:max(from_index - start, 0)]
            sent = token_ids[len(skipped):]
            if skipped:
                text_stream.push(skipped)  # already with the client: decoded for context only
            delta = GenerationDelta(request_id, text_stream.push(sent) if sent else "", sent, [])
            if entry.finish_reason is not None or text_stream.stopped:
                yield _last(delta, entry, text_stream, arrival, next_index)
                return
            if sent or delta.text:
                yield delta


def _last(delta: GenerationDelta, entry: TokenEntry, text_stream: TextStream, arrival: float,
          num_output_tokens: int) -> GenerationDelta:
    if entry.error is not None:  # the same type the scheduler ended it with (deadline, lost worker, ...)
        raise entry.error
    if entry.finish_reason is FinishReason.ERROR:
        raise Unavailable(f"request {delta.request_id!r} failed after {num_output_tokens} tokens")
    delta.text += text_stream.finish()
    e2e_ns = int((time.monotonic() - arrival) * 1e9)
    delta.finish = Finish(reason=FinishReason.STOP if text_stream.stopped else entry.finish_reason or FinishReason.STOP,
                          matched_stop=text_stream.matched_stop, prompt_tokens=entry.num_prompt_tokens,
                          completion_tokens=num_output_tokens, cached_prompt_tokens=0, queue_ns=0,
                          time_to_first_token_ns=0, decode_ns=0, e2e_ns=e2e_ns)
    return delta


async def _raise_if_lost(records: RequestStateReader | None, request_id: str) -> None:
    record = await records.get_record(request_id) if records is not None else None
    if record is not None and record.is_terminal:
        raise Unavailable(f"request {request_id!r} ended as {record.status.value} "
                          f"({record.error or record.finish_reason or 'no reason'}) without finishing its "
                          f"token stream; it was lost with its scheduler")


async def submit_or_attach(message, prepared: PreparedRequest, tokenizer: TextTokenizer, scheduler: SchedulerClient,
                           tokens: TokenStreamReader, records: RequestStateReader | None,
                           timeout_s: float | None, arrival: float, owner: str | None = None,
                           owners: RequestOwners | None = None,
                           claims: RequestClaims | None = None) -> AsyncIterator[GenerationDelta]:
    """The tokenmill.v1 Generate path with Redis. A client-chosen request_id is claimed first
    (gateway.id_claims): free, it runs; held by the same request, this call attaches to it; held by
    another, ALREADY_EXISTS. With resume_from_index a known id attaches from that index. Any other
    request is submitted as resumable. message: the GenerateRequest (its request_id and
    resume_from_index as the client sent them). owner: the caller's API key name (None: keys off);
    only the owner attaches to a known id (owners)."""
    request_id = prepared.request.request_id
    # read before any Redis call: the client's call ends when timeout_s (read by the caller) has passed
    deadline = time.time() + timeout_s if timeout_s is not None else None
    resume = message.HasField("resume_from_index")
    from_index = message.resume_from_index if resume else 0
    if message.request_id and not resume and claims is not None:
        deltas = claimed_generation(
            request_id, claims, request_fingerprint(owner, prepared.request),
            run=lambda: stream_generation(prepared, tokenizer, scheduler, timeout_s, arrival, resumable=True,
                                          owner=owner, deadline_unix_s=deadline),
            attach=lambda on_quiet: attach_generation(prepared, tokenizer, tokens, records, 0, timeout_s, on_quiet),
            has_started=lambda: _is_known(request_id, tokens, records),
            unclaimed=lambda: _submit_then_attach_if_taken(prepared, tokenizer, scheduler, tokens, records, timeout_s,
                                                           arrival, owner, owners, deadline))
    elif message.request_id and await _is_known(request_id, tokens, records):
        if not await _owned(request_id, owner, owners):  # another key's request: it does not exist for this one,
            raise NotFound("request", request_id) if resume else AlreadyExists("request", request_id)  # but its id is taken
        deltas = attach_generation(prepared, tokenizer, tokens, records, from_index, timeout_s)
    elif resume:
        raise NotFound("request", request_id)
    else:
        deltas = _submit_then_attach_if_taken(prepared, tokenizer, scheduler, tokens, records, timeout_s, arrival,
                                              owner, owners, deadline)
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            yield delta


async def _owned(request_id: str, owner: str | None, owners: RequestOwners | None) -> bool:
    return owner is None or (owners is not None and await owners.recorded_owner(request_id, wait_s=1.0) == owner)


async def _submit_then_attach_if_taken(prepared, tokenizer, scheduler, tokens, records, timeout_s, arrival,
                                       owner=None, owners=None, deadline=None):
    deltas = stream_generation(prepared, tokenizer, scheduler, timeout_s, arrival, resumable=True, owner=owner,
                               deadline_unix_s=deadline)
    try:
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                yield delta
        return
    except AlreadyExists:
        if not await _owned(prepared.request.request_id, owner, owners):
            raise
    # the same id was submitted a moment ago (its records not written yet): follow that one
    attached = attach_generation(prepared, tokenizer, tokens, records, 0, timeout_s)
    async with contextlib.aclosing(attached):
        async for delta in attached:
            yield delta


async def _is_known(request_id: str, tokens: TokenStreamReader, records: RequestStateReader | None) -> bool:
    # bounded: a slow or hung Redis must not hold a new request (DESIGN invariant 6)
    try:
        async with asyncio.timeout(_KNOWN_CHECK_TIMEOUT_S):
            if await tokens.exists(request_id):
                return True
            return records is not None and await records.get_record(request_id) is not None
    except (RedisError, OSError, TimeoutError) as error:  # Redis away: resume is unavailable, generation is not
        logger.warning("cannot tell whether request %r is known (Redis: %s); submitting it", request_id, error)
        return False
