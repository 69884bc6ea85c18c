"""The resumable requests a scheduler is running, so that the same scheduler, restarted after a
crash, can take them up again: one Redis hash per scheduler, `tokenmill:live:{scheduler_id}`,
request id -> what was submitted (opaque text here: the scheduler stores its SubmitRequest).

Together with the request's token stream (kvstore.token_streams: the tokens already streamed) this
is everything needed to re-admit it and recompute where it stood. Writes follow DESIGN invariant 6:
admitted() and ended() only queue; a background task writes the queue in order and keeps it to
retry with backoff while Redis is away. The hash's TTL is refreshed by every write, so the entries
of a scheduler that never comes back go away with it.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque

from redis.exceptions import RedisError

from core.outputs import FinishReason
from kvstore.background_flush import BackgroundFlush
from kvstore.client import connect
from kvstore.token_streams import TokenEntry, token_stream_key

logger = logging.getLogger(__name__)
LIVE_KEY_PREFIX = "tokenmill:live:"


def live_key(scheduler_id: str) -> str:
    return LIVE_KEY_PREFIX + scheduler_id


class LiveRequestWriter(BackgroundFlush):
    _task_name = "live-request-writer"

    def __init__(self, redis_url: str, scheduler_id: str, *, ttl_s: int = 3600, flush_interval_s: float = 0.01,
                 retry_max_s: float = 1.0) -> None:
        self._client = connect(redis_url)
        self._key = live_key(scheduler_id)
        self._ttl_s = ttl_s
        self._flush_interval_s = flush_interval_s
        self._retry_max_s = retry_max_s
        self._pending: deque[tuple[str, str | None]] = deque()  # (request id, submitted; None: ended), in order
        self._written: dict[str, asyncio.Future] = {}  # request id -> done once its admission is in Redis
        self._has_work = asyncio.Event()
        self.round_trips = 0  # pipelines sent (one per flush, failed ones included)

    @property
    def pending(self) -> int:
        """Changes not yet written."""
        return len(self._pending)

    def admitted(self, request_id: str, submitted: str) -> asyncio.Future:
        """Queues the request's submission; the future is done once a flush has written it (the scheduler
        holds the request's first output until then: scheduler.process.request_streams)."""
        self._pending.append((request_id, submitted))
        self._has_work.set()
        written = self._written[request_id] = asyncio.get_running_loop().create_future()
        return written

    def ended(self, request_id: str) -> None:
        self._pending.append((request_id, None))
        self._has_work.set()

    async def _flush(self) -> bool:
        """One round trip with three commands, however many requests changed: the queue is folded into
        each request's last change (changes to different requests commute; a request admitted and ended
        within one batch is only deleted)."""
        batch = list(self._pending)
        last: dict[str, str | None] = {}
        for request_id, submitted in batch:
            last[request_id] = submitted
        admitted = {request_id: submitted for request_id, submitted in last.items() if submitted is not None}
        ended = [request_id for request_id, submitted in last.items() if submitted is None]
        pipe = self._client.pipeline(transaction=False)
        if admitted:
            pipe.hset(self._key, mapping=admitted)
        if ended:
            pipe.hdel(self._key, *ended)
        pipe.expire(self._key, self._ttl_s)
        self.round_trips += 1
        try:
            await pipe.execute()
        except (RedisError, OSError, TimeoutError) as error:
            logger.warning("live request write failed, keeping %d changes to retry: %s", len(batch), error)
            return False
        for _ in batch:
            self._pending.popleft()
        for request_id in last:
            written = self._written.pop(request_id, None)
            if written is not None and not written.done():
                written.set_result(None)
        return True


class LiveRequestReader:
    """Start-up reads; they raise RedisError (or OSError / TimeoutError) when Redis is away."""

    def __init__(self, redis_url: str, scheduler_id: str) -> None:
        self._client = connect(redis_url, socket_timeout_s=5.0)
        self._key = live_key(scheduler_id)

    async def live(self) -> dict[str, str]:
        """Request id -> what was submitted, for every request this scheduler had not ended."""
        return await self._client.hgetall(self._key)

    async def streamed(self, request_id: str) -> tuple[list[int], FinishReason | None]:
        """The output tokens already in the request's token stream, in order, and its finish reason
        if the stream says it ended."""
        token_ids: list[int] = []
        for _, fields in await self._client.xrange(token_stream_key(request_id)):
            entry = TokenEntry.from_fields(fields)
            token_ids += entry.token_ids[max(len(token_ids) - entry.index, 0):]  # a resent entry repeats
            if entry.finish_reason is not None:
                return token_ids, entry.finish_reason
        return token_ids, None

    async def forget(self, request_id: str) -> None:
        await self._client.hdel(self._key, request_id)

    async def aclose(self) -> None:
        await self._client.aclose()
