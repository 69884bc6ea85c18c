"""Publishes this replica's load and cached prefix keys to Redis every REPORT_INTERVAL_S, so gateways
can spread requests over replicas and send a prompt to the replica that already holds its prefix.

Off the hot path (invariant 6): the engine loop never waits for it; a report reads the scheduler's
counters between steps (same event loop, so no locks) and a failed report is logged and retried at
the next tick. The prefix set is sent as a diff; every FULL_REWRITE_EVERY reports (and after any
failure) it is rewritten whole, which also repairs a set that expired or a Redis that restarted.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time

from redis.exceptions import RedisError

from kvstore.client import connect
from kvstore.replica_keys import LOAD_TTL_S, PREFIX_TTL_S, REPORT_INTERVAL_S, load_key, prefixes_key
from scheduler.process.loop import EngineLoop
from plumbing.process import cancel_and_wait

logger = logging.getLogger("tokenmill.scheduler.load_report")

FULL_REWRITE_EVERY = 20


class LoadReporter:
    def __init__(self, redis_url: str, replica: str, loop: EngineLoop,
                 interval_s: float = REPORT_INTERVAL_S) -> None:
        self.replica = replica  # the address gateways dial, HOST:PORT
        self.loop = loop
        self.interval_s = interval_s
        self._client = connect(redis_url)
        self._published: set[bytes] | None = None  # None: rewrite the whole set next time
        # bumped whenever the prefix set changes, so readers skip unchanged sets; a random start so a
        # restarted replica does not repeat a version a reader already holds
        self._version = random.randrange(1 << 30)
        self._num_reports = 0
        self._task: asyncio.Task | None = None
        self._failing = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="load-report")

    async def _run(self) -> None:
        while True:
            try:
                await self.publish_once()
                if self._failing:
                    logger.info("load reports to Redis resumed")
                self._failing = False
            except (RedisError, OSError) as error:
                if not self._failing:
                    logger.warning("load report to Redis failed (%s); retrying every %.1f s", error, self.interval_s)
                self._failing = True
                self._published = None
            await asyncio.sleep(self.interval_s)

    async def publish_once(self) -> None:
        scheduler = self.loop.scheduler
        stats = scheduler.stats()
        cached = scheduler.kv.pool.cached_keys()
        rewrite = self._published is None or self._num_reports % FULL_REWRITE_EVERY == 0
        added = cached if rewrite else cached - self._published
        removed = set() if rewrite else self._published - cached
        if rewrite or added or removed:
            self._version += 1
        pipe = self._client.pipeline(transaction=True)
        key = prefixes_key(self.replica)
        if rewrite:
            pipe.delete(key)
        if added:
            pipe.sadd(key, *(k.hex() for k in added))
        if removed:
            pipe.srem(key, *(k.hex() for k in removed))
        pipe.expire(key, PREFIX_TTL_S)
        pipe.hset(load_key(self.replica), mapping={
            "num_waiting_requests": stats.num_waiting, "num_running_requests": stats.num_running,
            "num_waiting_tokens": stats.num_waiting_tokens, "num_kv_pages_used": stats.num_used_blocks,
            "num_kv_pages_total": stats.num_blocks, "num_requests_total": self.loop.num_requests_total,
            "prefix_version": self._version, "reported_at_ms": int(time.time() * 1000)})
        pipe.expire(load_key(self.replica), LOAD_TTL_S)
        await pipe.execute()
        self._published = cached
        self._num_reports += 1

    async def aclose(self) -> None:
        await cancel_and_wait(self._task)
        try:  # leave now rather than attract traffic until the keys expire
            await self._client.delete(load_key(self.replica), prefixes_key(self.replica))
        except (RedisError, OSError):
            pass
        await self._client.aclose()
