"""Who follows a resumable request's token stream from Redis, so its scheduler can tell an orphan.

A resumable request's Submit call shows the scheduler that a gateway is there; when that call is gone
(its gateway died, or the scheduler restarted and re-admitted the request) a client can still follow
the request through any gateway, which reads the request's token stream (gateway.generation.resume) and meanwhile
keeps `tokenmill:followed:{request_id}` alive: set with a TTL of FOLLOW_TTL_S, renewed every
FOLLOW_RENEW_S. The scheduler (scheduler.process.orphans) aborts a request that has had neither a call nor
this key for its --orphan-timeout-s.

    followers = Followers(redis_url)
    await followers.mark("req-1")                 # gateway, while it reads the stream
    await followers.followed(["req-1", "req-2"])  # scheduler: {"req-1"}
"""
from __future__ import annotations

from kvstore.client import connect

FOLLOWED_PREFIX = "tokenmill:followed:"
FOLLOW_TTL_S = 10  # a follower that went away stops counting after this
FOLLOW_RENEW_S = 2.0  # how often a follower renews its key (well inside the TTL)


def followed_key(request_id: str) -> str:
    return FOLLOWED_PREFIX + request_id


class Followers:
    """Plain awaits; they raise RedisError (or OSError / TimeoutError) when Redis is away."""

    def __init__(self, redis_url: str) -> None:
        self._client = connect(redis_url)

    async def mark(self, request_id: str, ttl_s: int = FOLLOW_TTL_S) -> None:
        await self._client.set(followed_key(request_id), "1", ex=ttl_s)

    async def followed(self, request_ids: list[str]) -> set[str]:
        """Those of request_ids that a gateway followed within the last FOLLOW_TTL_S."""
        async with self._client.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.exists(followed_key(request_id))
            found = await pipe.execute()
        return {request_id for request_id, count in zip(request_ids, found) if count}

    async def aclose(self) -> None:
        await self._client.aclose()
