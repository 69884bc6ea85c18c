"""Aborting resumable requests that nobody follows any more (`--orphan-timeout-s`).

A resumable request runs on when its Submit call goes away (its gateway died; or this scheduler
restarted and re-admitted it, scheduler.process.readmission), so that a client can resume it by id through
any gateway. If none does, it would decode to max_tokens for nobody, holding KV pages and batch slots.
A gateway that follows such a request from its Redis token stream (a client's resume, or its own
stream going on after a scheduler restart: gateway.generation.resume) keeps the request's follower key alive
(kvstore.followers). Every check (a quarter of the timeout, at most a second) this aborts each request
that has been without its call for the timeout and whose follower key is absent; a followed one starts
a new timeout. Its record ends cancelled and its token stream's last entry says ABORT.

    reaper = OrphanReaper(loop, Followers(redis_url), timeout_s=60.0)
    reaper.start()
    ...
    await reaper.aclose()

The step loop never waits for this (DESIGN invariant 9): it runs as its own task, and with Redis away
it aborts nothing (an orphan cannot be told from a followed request then; it keeps running).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from core.outputs import FinishReason
from kvstore.followers import Followers
from scheduler.process.loop import EngineLoop

logger = logging.getLogger(__name__)
_READ_TIMEOUT_S = 2.0


def start_orphan_reaper(loop: EngineLoop, redis_url: str, timeout_s: float) -> OrphanReaper | None:
    """A started reaper for the loop's requests; None when timeout_s is 0 (orphans run to their end)."""
    if timeout_s <= 0:
        return None
    reaper = OrphanReaper(loop, Followers(redis_url), timeout_s)
    reaper.start()
    return reaper


class OrphanReaper:
    def __init__(self, loop: EngineLoop, followers: Followers, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """loop: the EngineLoop (its streams say which requests run without a call; abort ends one)."""
        self._loop = loop
        self._followers = followers
        self.timeout_s = timeout_s
        self._clock = clock
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="orphan-reaper")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._followers.aclose()

    async def _run(self) -> None:
        interval_s = min(max(self.timeout_s / 4, 0.05), 1.0)
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - one failed check must not end the checks
                logger.exception("orphan check failed")

    async def check(self) -> list[str]:
        """Aborts the requests that are orphans now; returns their ids."""
        now = self._clock()
        due = [request_id for request_id, since in self._loop.streams.detached().items()
               if now - since >= self.timeout_s]
        if not due:
            return []
        try:
            async with asyncio.timeout(_READ_TIMEOUT_S):
                followed = await self._followers.followed(due)
        except (RedisError, OSError, TimeoutError) as error:
            logger.warning("cannot tell whether %d detached requests are followed (Redis: %r); none is aborted",
                           len(due), error)
            return []
        orphans = []
        for request_id in due:
            if request_id in followed:
                self._loop.streams.detach(request_id, now)  # followed: a new timeout from now
            elif self._loop.abort(request_id, FinishReason.ABORT):
                orphans.append(request_id)
        if orphans:
            logger.warning("aborted %d requests that nobody followed for %gs after their client went away "
                           "(--orphan-timeout-s): %s", len(orphans), self.timeout_s, ", ".join(orphans[:10]))
        return orphans
