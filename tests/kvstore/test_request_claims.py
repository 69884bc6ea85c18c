"""Request id claims against a real Redis: one atomic claim per id, verdicts by fingerprint, and a
release that only ever deletes the caller's own claim."""
from __future__ import annotations

import asyncio

from core.requests import GenerationRequest
from core.sampling import SamplingParams
from kvstore.request_claims import ClaimVerdict, RequestClaims, request_fingerprint


def fingerprint(prompt: list[int], owner: str | None = None, **params) -> str:
    return request_fingerprint(owner, GenerationRequest("id", prompt, SamplingParams(**params)))


def test_the_fingerprint_covers_owner_prompt_and_every_sampling_parameter():
    base = fingerprint([1, 2, 3], temperature=0.0)
    assert fingerprint([1, 2, 3], temperature=0.0) == base
    assert len({base, fingerprint([1, 2, 4], temperature=0.0), fingerprint([1, 2, 3], "alice", temperature=0.0),
                fingerprint([1, 2, 3], temperature=0.5), fingerprint([1, 2, 3], temperature=0.0, seed=7)}) == 5


async def test_twenty_concurrent_claims_one_wins_the_same_request_attaches_another_is_refused(fresh_redis):
    clients = [RequestClaims(fresh_redis) for _ in range(4)]  # separate connections, as replicas have
    try:
        same = fingerprint([1, 2, 3])
        verdicts = await asyncio.gather(*(clients[i % 4].claim("race", same) for i in range(20)))
        assert [v.verdict for v in verdicts].count(ClaimVerdict.CLAIMED) == 1
        assert {v.verdict for v in verdicts} == {ClaimVerdict.CLAIMED, ClaimVerdict.SAME}
        assert len({v.value for v in verdicts}) == 1  # everyone sees the winner's claim
        assert (await clients[0].claim("race", fingerprint([9]))).verdict is ClaimVerdict.DIFFERENT
    finally:
        for client in clients:
            await client.aclose()


async def test_release_deletes_only_the_callers_claim_so_a_retry_claims_afresh(fresh_redis):
    claims = RequestClaims(fresh_redis, ttl_s=60)
    try:
        first = await claims.claim("refused", fingerprint([1]))
        assert await claims.release(first) and not await claims.holds(first)
        second = await claims.claim("refused", fingerprint([1]))
        assert second.verdict is ClaimVerdict.CLAIMED
        assert not await claims.release(first), "a stale holder must not delete the new claim"
        assert await claims.holds(second)
    finally:
        await claims.aclose()
