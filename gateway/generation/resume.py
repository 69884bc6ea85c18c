"""Attaching to a request that is already running (or done) instead of running it again: the client
resumes its stream after its gateway died, or sent the same request_id twice; and a gateway's own
stream going on after its scheduler died (the restarted one re-admits the request).

    store = ResumeStore(token_reader, state_reader, owners, claims, followers, scheduler_wait_s=30)
    deltas = submit_or_attach(prepared, call, side, store)     # the route with Redis (Generations.stream)
    deltas = attach_generation(prepared, call, side, store, from_index=17)

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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from gateway.generation.stream import Finish, GenerationDelta, stream_generation, tool_calls_seen
from gateway.generation.context import CallContext, SchedulerSide
from gateway.generation.id_claims import ClaimPaths, claimed_generation
from gateway.generation.ownership import RequestOwners
from gateway.prepare.request_builder import PreparedRequest
from gateway.telemetry import RequestObserver
from gateway.text.text_stream import TextStream
from kvstore.followers import FOLLOW_RENEW_S, Followers
from kvstore.request_claims import RequestClaims, request_fingerprint
from kvstore.state_reader import RequestStateReader
from kvstore.token_streams import TokenEntry, TokenStreamReader
from core.errors import AlreadyExists, DeadlineExceeded, NotFound, ServingError, Unavailable
from core.outputs import FinishReason

logger = logging.getLogger(__name__)

# A record that is terminal while its token stream says nothing more for this long was lost with its
# scheduler (the final entry is written after the record only by a few milliseconds).
_LOST_AFTER_S = 3.0
_KNOWN_CHECK_TIMEOUT_S = 0.5


@dataclass(slots=True)
class ResumeStore:
    """The Redis side of resuming, shared by the three APIs (None for an API without Redis)."""

    tokens: TokenStreamReader  # the requests' token streams
    records: RequestStateReader | None  # their records (is an id known; did a request end without its stream)
    owners: RequestOwners | None = None  # whose request an id is (None: keys off)
    claims: RequestClaims | None = None  # client-chosen ids bound to one request
    followers: Followers | None = None  # marks a followed request, so its scheduler keeps it (scheduler.process.orphans)
    # --scheduler-resume-wait-s (its default: gateway.options): how long a stream whose scheduler went away
    # waits for the restarted scheduler's next token before it ends UNAVAILABLE; 0: it ends at once, as
    # before there was resume
    scheduler_wait_s: float = field(kw_only=True)

    async def aclose(self) -> None:
        """Closes the Redis clients this store owns (the records reader is its creator's)."""
        await self.tokens.aclose()
        for client in (self.claims, self.followers):
            if client is not None:
                await client.aclose()


@dataclass(frozen=True, slots=True)
class WhileQuiet:
    """What following a token stream does while it says nothing."""

    # awaited about once a second while the stream is still empty (gateway.generation.id_claims checks
    # that the request it waits for is still coming)
    check: Callable[[], Awaitable[None]] | None = None
    limit_s: float | None = None  # saying nothing this long ends the call UNAVAILABLE, naming why
    why: str = ""  # why it went quiet


async def attach_generation(prepared: PreparedRequest, call: CallContext, side: SchedulerSide, store: ResumeStore,
                            from_index: int = 0, quiet: WhileQuiet = WhileQuiet()) -> AsyncIterator[GenerationDelta]:
    """The request's deltas from its token stream, from token from_index on, until it ends or call's
    deadline passes."""
    request_id = prepared.request.request_id
    text_stream = TextStream(side.tokenizer, prepared.request.prompt_token_ids, prepared.stop)
    arrival = time.monotonic()
    after, next_index, quiet_since, followed_at = "0", 0, time.monotonic(), 0.0
    while True:
        followed_at = await _mark_followed(store, request_id, followed_at)
        after, entries = await store.tokens.read(request_id, after, block_ms=1000)
        if not entries:
            if call.deadline_unix_s is not None and time.time() > call.deadline_unix_s:
                raise DeadlineExceeded(f"request {request_id!r}: deadline passed while attached to its stream")
            if quiet.check is not None and after == "0":
                await quiet.check()
            if time.monotonic() - quiet_since > _LOST_AFTER_S:
                await _raise_if_lost(store.records, request_id)
            if quiet.limit_s is not None and time.monotonic() - quiet_since > quiet.limit_s:
                raise Unavailable(f"request {request_id!r}: {quiet.why}, and it did not go on within "
                                  f"{quiet.limit_s:g}s (--scheduler-resume-wait-s); {next_index} tokens were sent")
            continue
        quiet_since = time.monotonic()
        for entry in entries:
            if entry.index > next_index:  # never skip past a hole: the client would miss those tokens silently
                raise Unavailable(f"request {request_id!r}: its token stream lacks tokens {next_index} to "
                                  f"{entry.index - 1} (they never reached Redis); the client has "
                                  f"{max(next_index, from_index)} tokens")
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


async def _mark_followed(store: ResumeStore, request_id: str, followed_at: float) -> float:
    """Renews the request's follower key (kvstore.followers) when due; returns when it was last renewed."""
    now = time.monotonic()
    if store.followers is None or now - followed_at < FOLLOW_RENEW_S:
        return followed_at
    try:
        async with asyncio.timeout(_KNOWN_CHECK_TIMEOUT_S):
            await store.followers.mark(request_id)
    except (RedisError, OSError, TimeoutError) as error:  # the read below says whether Redis is away
        logger.debug("could not mark request %r followed: %r", request_id, error)
    return now


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


async def submit_or_attach(prepared: PreparedRequest, call: CallContext, side: SchedulerSide,
                           store: ResumeStore) -> AsyncIterator[GenerationDelta]:
    """The route with Redis (gateway.generation.generations), for every API. call.chosen_id: the client
    chose the request id (tokenmill.v1 request_id, HTTP X-Request-Id); it is claimed first
    (gateway.generation.id_claims): free, it runs; held by the same request, this call attaches to it; held
    by another, ALREADY_EXISTS. call.resume_from (tokenmill.v1 resume_from_index, HTTP Last-Event-ID): a
    known id attaches from that index. Any other request is submitted as resumable, and goes on through a
    scheduler restart (_run_resuming). call.owner: the caller's API key name (None: keys off); only the
    owner attaches to a known id (store.owners)."""
    request_id = prepared.request.request_id

    def run() -> AsyncIterator[GenerationDelta]:
        return _run_resuming(prepared, call, side, store)

    if call.chosen_id and call.resume_from is None and store.claims is not None:
        paths = ClaimPaths(run, lambda on_quiet: attach_generation(prepared, call, side, store, 0, WhileQuiet(on_quiet)),
                           has_started=lambda: _is_known(request_id, store),
                           unclaimed=lambda: _submit_then_attach_if_taken(run, prepared, call, side, store))
        deltas = claimed_generation(request_id, store.claims, request_fingerprint(call.owner, prepared.request), paths)
    elif call.chosen_id and await _is_known(request_id, store):
        if not await _owned(request_id, call.owner, store.owners):  # another key's request: it does not exist for
            raise NotFound("request", request_id) if call.resume_from is not None else AlreadyExists("request", request_id)
        deltas = attach_generation(prepared, call, side, store, call.resume_from or 0)  # this one; its id is taken
    elif call.resume_from is not None:
        raise NotFound("request", request_id)
    else:
        deltas = _submit_then_attach_if_taken(run, prepared, call, side, store)
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            yield delta


async def _run_resuming(prepared: PreparedRequest, call: CallContext, side: SchedulerSide,
                        store: ResumeStore) -> AsyncIterator[GenerationDelta]:
    """stream_generation, resumable. When its scheduler goes away under it (UNAVAILABLE once the request
    was taken), the stream goes on from Redis: the restarted scheduler re-admits the request
    (scheduler.process.readmission) and writes its next tokens to the same token stream, which this follows
    from the index the client has reached (_follow_after_break). The client sees one stream, with no
    token lost or repeated; the request's span, metrics and log line tell one request too."""
    request_id, delivered = prepared.request.request_id, 0
    observer = RequestObserver(prepared.request, call.arrival)
    deltas = stream_generation(prepared, call, side, observer=observer, resumable=True)
    text: list[str] = []  # a tools chat's output before the break, parsed with the rest when it ends
    try:
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                delivered += len(delta.token_ids)
                text.append(delta.text)
                yield delta
        return
    except Unavailable as error:
        if store.scheduler_wait_s <= 0 or not (delivered or await _is_known(request_id, store)):
            observer.on_error(error)
            raise  # refused before a scheduler took it (none reachable, its breaker open): nothing runs
        broken = error
    logger.warning("request %r: %s; following its token stream from index %d while the scheduler restarts",
                   request_id, broken, delivered)
    rest = attach_generation(prepared, call, side, store, delivered,
                             WhileQuiet(limit_s=store.scheduler_wait_s, why=f"its scheduler went away ({broken})"))
    async with contextlib.aclosing(_follow_after_break(rest, side, observer, _ToolText(prepared, text))) as followed:
        async for delta in followed:
            yield delta


@dataclass(slots=True)
class _ToolText:
    """A tools chat's text across a scheduler restart, so its ending says tool_calls as an unbroken one would."""

    prepared: PreparedRequest
    text: list[str]

    def seen(self, delta: GenerationDelta):
        self.text.append(delta.text)
        return tool_calls_seen(self.prepared, "".join(self.text)) if delta.finish is not None else None


async def _follow_after_break(rest: AsyncIterator[GenerationDelta], side: SchedulerSide,
                              observer: RequestObserver, tool_text: _ToolText) -> AsyncIterator[GenerationDelta]:
    """The rest of a request whose scheduler went away, from its token stream, observed as the same request.
    Left early (its client went away) or failed, the request is aborted: nobody reads it any more."""
    finished = False
    try:
        async with contextlib.aclosing(rest):
            async for delta in rest:
                observer.on_tokens(len(delta.token_ids))
                tool_calls = tool_text.seen(delta)
                if delta.finish is not None:
                    finished = True
                    observer.on_finish(delta.finish, tool_calls)
                yield delta
    except ServingError as error:
        observer.on_error(error)
        raise
    finally:
        if not finished:
            observer.on_disconnect()  # a no-op after on_error
            side.abort_in_background(observer.request_id)
async def _owned(request_id: str, owner: str | None, owners: RequestOwners | None) -> bool:
    return owner is None or (owners is not None and await owners.recorded_owner(request_id, wait_s=1.0) == owner)


async def _submit_then_attach_if_taken(run: Callable[[], AsyncIterator[GenerationDelta]], prepared: PreparedRequest,
                                       call: CallContext, side: SchedulerSide,
                                       store: ResumeStore) -> AsyncIterator[GenerationDelta]:
    deltas = run()
    try:
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                yield delta
        return
    except AlreadyExists:
        if not await _owned(prepared.request.request_id, call.owner, store.owners):
            raise
    # the same id was submitted a moment ago (its records not written yet): follow that one
    attached = attach_generation(prepared, call, side, store)
    async with contextlib.aclosing(attached):
        async for delta in attached:
            yield delta


async def _is_known(request_id: str, store: ResumeStore) -> bool:
    # bounded: a slow or hung Redis must not hold a new request (DESIGN invariant 6)
    try:
        async with asyncio.timeout(_KNOWN_CHECK_TIMEOUT_S):
            if await store.tokens.exists(request_id):
                return True
            return store.records is not None and await store.records.get_record(request_id) is not None
    except (RedisError, OSError, TimeoutError) as error:  # Redis away: resume is unavailable, generation is not
        logger.warning("cannot tell whether request %r is known (Redis: %s); submitting it", request_id, error)
        return False
