"""The Redis connection every kvstore class uses."""
from __future__ import annotations

import redis.asyncio as redis_asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def connect(redis_url: str, *, socket_timeout_s: float = 2.0) -> redis_asyncio.Redis:
    """A lazily connecting client that fails fast instead of retrying inside redis-py.

    redis-py's default retries a failing command ten times with backoff, holding the batch that long;
    the state writer keeps its own backoff and keeps coalescing changes meanwhile. The socket timeout
    bounds how long a hung Redis can hold one write.
    """
    return redis_asyncio.Redis.from_url(
        redis_url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )
