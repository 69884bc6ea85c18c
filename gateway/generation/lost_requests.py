"""Ends in Redis the records of requests whose scheduler went away mid-stream.

A scheduler killed with -9 writes nothing more, so the records of its requests would stay "running"
for their whole TTL. The gateway saw those streams break, so it marks them failed itself, in the
background (the client already has its UNAVAILABLE). Only records that are not terminal change (a
request the scheduler finished, failed or cancelled itself keeps its outcome); a missing one is
created as failed when the scheduler had sent tokens for it, since the scheduler may have died
before its batched first write.
"""
from __future__ import annotations

import asyncio
import logging

from core.errors import ServingError
from kvstore.state_reader import RequestStateReader

logger = logging.getLogger(__name__)


class LostRequestRecorder:
    def __init__(self, state_reader: RequestStateReader) -> None:
        self._state_reader = state_reader
        self._tasks: set[asyncio.Task] = set()

    def __call__(self, request_id: str, error: ServingError, accepted: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._mark(request_id, error, accepted))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _mark(self, request_id: str, error: ServingError, accepted: bool) -> None:
        try:
            # an accepted request's record is created if missing (the scheduler may have died before
            # its batched first write); one that may never have reached the scheduler is not invented
            marked = await self._state_reader.mark_orphans_failed([request_id], error, must_exist=not accepted)
        except Exception as exc:  # noqa: BLE001 - Redis away: the record keeps its last status
            logger.warning("could not mark lost request %r failed in Redis: %s", request_id, exc)
            return
        if marked:
            logger.info("request %r lost with its scheduler: record marked failed", request_id)
