"""Whether Redis answers, for readiness reporting (never for the hot path).

Redis being away degrades bookkeeping only (DESIGN invariant 6), so a process keeps serving and
reports the degradation on its own grpc.health.v1 service name, REDIS_HEALTH_SERVICE: NOT_SERVING
while Redis is unreachable or state writes are failing, SERVING again once they catch up. Liveness
("") and the process's readiness service are left alone, so load balancers keep routing to it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from kvstore.client import connect

logger = logging.getLogger(__name__)
REDIS_HEALTH_SERVICE = "tokenmill.redis"


async def watch_redis(redis_url: str, writes_healthy: Callable[[], bool],
                      report: Callable[[bool], Awaitable[None]], interval_s: float = 0.5) -> None:
    """Calls report(ok) whenever Redis's state changes (and once at the start); runs until cancelled."""
    client = connect(redis_url, socket_timeout_s=1.0)
    last = None
    try:
        while True:
            try:
                ok = bool(await client.ping()) and writes_healthy()
            except (RedisError, OSError, TimeoutError):
                ok = False
            if ok != last:
                logger.log(logging.INFO if ok else logging.WARNING, "Redis %s",
                           "reachable" if ok else "unreachable or failing: request records are delayed")
                await report(ok)
                last = ok
            await asyncio.sleep(interval_s)
    finally:
        await client.aclose()
