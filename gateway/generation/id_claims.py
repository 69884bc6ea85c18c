"""A client-chosen request id through its claim (kvstore.request_claims): run it, attach to it, or
refuse it, so one id never runs two requests and one request never runs twice.

    deltas = claimed_generation(request_id, claims, fingerprint, ClaimPaths(run, attach, has_started, unclaimed))

run(): submits (this caller holds the claim); a refusal before any token releases the claim, so a
retry claims afresh instead of waiting on a request that never ran. attach(on_quiet): follows the
holder's token stream; while it is still empty, on_quiet checks the claim and raises ClaimLetGo when
the holder released it or died before submitting (then this caller claims again).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from redis.exceptions import RedisError

from core.errors import AlreadyExists, Cancelled, DeadlineExceeded, ServingError, Unavailable
from kvstore.request_claims import ABANDONED_AFTER_S, Claim, ClaimVerdict, RequestClaims

logger = logging.getLogger(__name__)
_CLAIM_TIMEOUT_S = 0.5  # a hung Redis delays a request with a client-chosen id by at most this
_MAX_ATTEMPTS = 4  # claim -> holder refused -> claim again ...; more means the id is contested


class RequestIdTaken(AlreadyExists):
    """ALREADY_EXISTS: the id is bound to a different request (prompt, parameters or API key)."""

    def __init__(self, request_id: str) -> None:
        super().__init__("request_id", request_id)
        self.message = (f"request_id {request_id!r} is already taken by a different request (another prompt, "
                        "sampling parameters or API key); use a new id, or send the same request to attach to it")
        self.args = (self.message,)


class ClaimLetGo(Exception):
    """The claim an attacher waited on was released or abandoned: claim again."""


@dataclass(frozen=True, slots=True)
class ClaimPaths:
    """The ways on from a claim, each a call that starts a stream of deltas."""

    run: Callable[[], AsyncIterator]  # this caller holds the claim: submit
    attach: Callable[[Callable[[], Awaitable[None]]], AsyncIterator]  # attach(on_quiet): follow the holder's stream
    has_started: Callable[[], Awaitable[bool]]  # the scheduler took the request (its record or token stream exists)
    # the path without a claim, for when Redis does not answer (generation must not wait for it, DESIGN
    # invariant 6; the scheduler still refuses an id that is live there)
    unclaimed: Callable[[], AsyncIterator]


async def claimed_generation(request_id: str, claims: RequestClaims, fingerprint: str,
                             paths: ClaimPaths) -> AsyncIterator:
    for _ in range(_MAX_ATTEMPTS):
        try:
            async with asyncio.timeout(_CLAIM_TIMEOUT_S):
                claim = await claims.claim(request_id, fingerprint)
        except (RedisError, OSError, TimeoutError) as error:
            logger.warning("cannot claim request_id %r (Redis: %r); submitting it unclaimed", request_id, error)
            deltas = paths.unclaimed()
        else:
            deltas = _follow(claim, claims, paths)
        try:
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    yield delta
            return
        except ClaimLetGo:
            continue
    raise Unavailable(f"request_id {request_id!r} changed hands {_MAX_ATTEMPTS} times while this call waited; retry")


def _follow(claim: Claim, claims: RequestClaims, paths: ClaimPaths) -> AsyncIterator:
    if claim.verdict is ClaimVerdict.DIFFERENT:
        raise RequestIdTaken(claim.request_id)
    if claim.verdict is ClaimVerdict.CLAIMED:
        return _run_holding(claim, claims, paths.run())
    return paths.attach(lambda: _check_claim(claim, claims, paths.has_started))


async def _run_holding(claim: Claim, claims: RequestClaims, deltas: AsyncIterator) -> AsyncIterator:
    answered = False
    try:
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                answered = True
                yield delta
    except ServingError as error:
        # refused before any token (queue full, invalid, no scheduler): nothing runs under this id.
        # A deadline or a cancel may come after the scheduler took it: its ending is in its stream.
        if not answered and not isinstance(error, (Cancelled, DeadlineExceeded)):
            await _release_quietly(claim, claims)
        raise


async def _release_quietly(claim: Claim, claims: RequestClaims) -> None:
    try:
        await claims.release(claim)
    except Exception as error:  # noqa: BLE001 - Redis away: the claim stays; attachers find it abandoned
        logger.warning("could not release the claim on request_id %r: %r", claim.request_id, error)


async def _check_claim(claim: Claim, claims: RequestClaims, has_started: Callable[[], Awaitable[bool]]) -> None:
    try:
        await _check_claim_once(claim, claims, has_started)
    except (RedisError, OSError, TimeoutError):
        pass  # Redis away: keep following the stream; the next quiet second checks again


async def _check_claim_once(claim: Claim, claims: RequestClaims, has_started: Callable[[], Awaitable[bool]]) -> None:
    if not await claims.holds(claim):
        raise ClaimLetGo  # released after a refusal, or taken over: claim again
    if time.time() - claim.claimed_at > ABANDONED_AFTER_S and not await has_started():
        logger.warning("request_id %r: its claim is %.0f s old and nothing ran; the gateway that claimed it "
                       "is gone, claiming it anew", claim.request_id, time.time() - claim.claimed_at)
        await claims.release(claim)  # compare-and-delete: only if nobody took it meanwhile
        raise ClaimLetGo
