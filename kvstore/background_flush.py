"""The background side every batched Redis writer shares: a task that flushes what callers queued,
gathering a short interval's changes into one pipeline and backing off while Redis is away.

A writer subclasses it and provides _pending (what is queued), _flush() (-> False: Redis could not be
reached, keep the batch), _client, and sets _has_work when it queues something.
"""
from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)


class BackgroundFlush:
    _task_name = "redis-writer"
    _flush_interval_s: float
    _retry_max_s: float
    _task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self._task_name)

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Stops the task, then writes what is left for at most timeout_s."""
        if self._task is not None:
            self._task.cancel()
        try:
            async with asyncio.timeout(timeout_s):
                while self._pending and await self._flush():
                    pass
        except TimeoutError:
            logger.warning("%s closed with %d changes unwritten", self._task_name, len(self._pending))
        await self._client.aclose()

    async def _run(self) -> None:
        retry_s = 0.05
        while True:
            if not self._pending:
                self._has_work.clear()
                await self._has_work.wait()
            await asyncio.sleep(self._flush_interval_s)  # let a step's changes gather into one pipeline
            if await self._flush():
                retry_s = 0.05
            else:
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, self._retry_max_s)
