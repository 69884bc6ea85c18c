"""gateway.generation.id_claims over a real Redis: a submission the scheduler refuses lets its claim go, so a
caller attached to that claim (or a retry) claims afresh and runs instead of waiting on nothing."""
from __future__ import annotations

import asyncio

import pytest

from core.errors import ResourceExhausted
from gateway.generation.id_claims import ClaimPaths, RequestIdTaken, claimed_generation
from kvstore.request_claims import ClaimVerdict, RequestClaims


async def _never_started() -> bool:
    return False


def _unused():
    raise AssertionError("Redis is up: the unclaimed path must not be taken")


async def _consume(deltas) -> list:
    return [delta async for delta in deltas]


async def test_a_refused_submission_releases_its_claim_and_the_waiting_caller_runs_it(fresh_redis):
    claims = RequestClaims(fresh_redis)
    refuse_first = asyncio.Event()
    runs: list[str] = []

    def run(name: str):
        async def deltas():
            runs.append(name)
            if name == "first":
                await refuse_first.wait()  # the second caller attaches while this one holds the claim
                raise ResourceExhausted("waiting queue is full (4096 requests)")
            yield "token"
        return deltas

    def attach(on_quiet):
        async def waiting():  # an empty token stream: the holder never produced anything
            while True:
                await on_quiet()  # raises ClaimLetGo once the holder let the claim go
                await asyncio.sleep(0.05)
                if False:  # an async generator that yields nothing
                    yield None
        return waiting()

    try:
        first = asyncio.create_task(_consume(claimed_generation(
            "queue-full", claims, "fp", ClaimPaths(run("first"), attach, _never_started, _unused))))
        await asyncio.sleep(0.2)
        second = asyncio.create_task(_consume(claimed_generation(
            "queue-full", claims, "fp", ClaimPaths(run("second"), attach, _never_started, _unused))))
        await asyncio.sleep(0.2)
        refuse_first.set()
        with pytest.raises(ResourceExhausted):
            await first
        assert await asyncio.wait_for(second, 10) == ["token"]
        assert runs == ["first", "second"]
        # the id is now the second caller's: a different request under it is refused naming it
        with pytest.raises(RequestIdTaken, match="request_id 'queue-full' is already taken by a different request"):
            await _consume(claimed_generation("queue-full", claims, "other",
                                              ClaimPaths(run("third"), attach, _never_started, _unused)))
        assert (await claims.claim("queue-full", "fp")).verdict is ClaimVerdict.SAME
    finally:
        await claims.aclose()
