"""Batched, asynchronous writes of request state to Redis (DESIGN invariant 6: never on the hot path).

The scheduler loop calls `update()` and the typed helpers synchronously; they only merge the change
into an in-memory dict (O(1), no I/O) and return. A background task owned by the same event loop
writes what is pending, one pipeline per batch. When Redis is slow, absent or restarting, changes keep
coalescing in memory (bounded by `max_pending`, oldest dropped first and counted), the task retries
with backoff and catches up once Redis answers again. Nothing here raises into the caller.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass

from redis.exceptions import RedisError

from kvstore.client import connect
from kvstore.record_update import UPDATE_RECORDS_LUA, RecordUpdate, parse_results, script_args
from core.errors import ServingError
from core.outputs import FinishReason
from kvstore.records import RecordStatus, encode_field
from plumbing.telemetry.tracing import WriteCauses

logger = logging.getLogger(__name__)

# accepts the enum members and their string values alike
_STATUS_VALUES: dict[object, str] = {status: status.value for status in RecordStatus} | {
    status.value: status.value for status in RecordStatus
}


@dataclass(slots=True, frozen=True)
class WriterStats:
    healthy: bool  # False from a failed write until the next successful one
    writes: int  # records written
    batches: int  # batches written, one round trip each
    failures: int  # batch writes that failed (Redis away or timing out) + records Redis errored on
    dropped: int  # record changes dropped past max_pending, oldest first
    rejected: int  # writes refused in whole or part: terminal records, disallowed transitions
    invalid: int  # update() calls ignored for an unknown field or a bad value
    pending: int  # records waiting to be written


class RequestStateWriter:
    def __init__(
        self,
        redis_url: str,
        *,
        ttl_s: int = 3600,
        batch_max: int = 256,
        flush_interval_s: float = 0.05,
        max_pending: int = 100_000,
        retry_initial_s: float = 0.05,
        retry_max_s: float = 1.0,
        socket_timeout_s: float = 2.0,
        close_timeout_s: float = 2.0,
    ) -> None:
        for name, value, minimum in (
            ("ttl_s", ttl_s, 1),
            ("batch_max", batch_max, 1),
            ("max_pending", max_pending, 1),
        ):
            if not isinstance(value, int) or value < minimum:
                raise ValueError(f"RequestStateWriter {name} must be an int >= {minimum}, got {value!r}")
        if flush_interval_s < 0:
            raise ValueError(f"RequestStateWriter flush_interval_s must be >= 0, got {flush_interval_s}")
        self._ttl_s = ttl_s
        # a batch in flight cannot be trimmed, so it must fit inside the pending bound
        self._batch_max = min(batch_max, max_pending)
        self._flush_interval_s = flush_interval_s
        self._max_pending = max_pending
        self._retry_initial_s = retry_initial_s
        self._retry_max_s = retry_max_s
        self._close_timeout_s = close_timeout_s
        self._client = connect(redis_url, socket_timeout_s=socket_timeout_s)
        self._script = self._client.register_script(UPDATE_RECORDS_LUA)
        self._write_id_prefix = uuid.uuid4().hex[:12] + ":"
        self._write_seq = itertools.count()

        # request_id -> its coalesced change; insertion order is age, so the oldest drops first
        self._pending: OrderedDict[str, RecordUpdate] = OrderedDict()
        # taken out of _pending for writing; resent unchanged after a failure so the script's
        # write_id check can tell a half-applied pipeline from a new write
        self._batch: deque[RecordUpdate] = deque()
        self._sending = False
        # written(): futures of callers waiting for a record's changes in _pending / in _batch
        self._pending_waiters: dict[str, list[asyncio.Future]] = {}
        self._batch_waiters: dict[str, list[asyncio.Future]] = {}
        self._task: asyncio.Task | None = None
        self._closing = False
        self._has_work_event = asyncio.Event()
        self._batch_full_event = asyncio.Event()
        self._stop_event = asyncio.Event()

        self._healthy = True
        self._writes = self._batches = self._failures = 0
        self._dropped = self._rejected = self._invalid = 0
        self._logged_invalid: set[str] = set()
        self._causes = WriteCauses()  # the step spans whose changes the next batch carries

    # ---- caller side: synchronous, O(1), no I/O, never raises ----

    def update(self, request_id: str, **fields: object) -> None:
        """Merge a change into the pending write for `request_id`. A None value means "no change"."""
        try:
            status = fields.pop("status", None)
            if status is not None:
                status = _STATUS_VALUES[status]
            encoded = {name: encode_field(name, v) for name, v in fields.items() if v is not None}
        except KeyError:
            return self._ignore_invalid(request_id, f"unknown record status {status!r}")
        except Exception as exc:  # a caller bug must not stop token generation; count it, log once
            return self._ignore_invalid(request_id, str(exc))
        self._causes.note()
        pending = self._pending.get(request_id)
        if pending is None:
            pending = RecordUpdate(request_id)
            self._pending[request_id] = pending
            if len(self._pending) + len(self._batch) > self._max_pending:
                self._drop_oldest()
            self._has_work_event.set()
        elif pending.is_terminal:
            self._rejected += 1  # terminal statuses are final; the server would refuse it too
            return
        if status is not None:
            pending.add_status(status)
        for name, value in encoded.items():
            pending.set_field(name, value)
        if len(self._pending) >= self._batch_max:
            self._batch_full_event.set()

    def queued(self, request_id: str, *, num_prompt_tokens: int | None = None, model: str | None = None,
               priority: int | None = None, created_at: float | None = None, owner: str | None = None) -> None:
        created_at = time.time() if created_at is None else created_at
        self.update(request_id, status=RecordStatus.QUEUED, num_prompt_tokens=num_prompt_tokens, model=model,
                    priority=priority, owner=owner, created_at=created_at)

    def running(self, request_id: str, *, at: float | None = None) -> None:
        self.update(request_id, status=RecordStatus.RUNNING, first_scheduled_at=_now(at))

    def progress(self, request_id: str, *, num_output_tokens: int, at: float | None = None) -> None:
        first_token_at = _now(at) if num_output_tokens > 0 else None
        self.update(request_id, num_output_tokens=num_output_tokens, first_token_at=first_token_at)

    def preempted(self, request_id: str) -> None:
        """Back to the queue for recompute; the server counts it in num_preemptions."""
        self.update(request_id, status=RecordStatus.QUEUED)

    def finished(self, request_id: str, *, finish_reason: FinishReason = FinishReason.STOP,
                 num_output_tokens: int | None = None, at: float | None = None) -> None:
        self.update(request_id, status=RecordStatus.FINISHED, finish_reason=finish_reason,
                    num_output_tokens=num_output_tokens, finished_at=_now(at))

    def failed(self, request_id: str, *, error: ServingError, num_output_tokens: int | None = None,
               at: float | None = None) -> None:
        self.update(request_id, status=RecordStatus.FAILED, error=str(error), error_code=error.code,
                    finish_reason=FinishReason.ERROR, num_output_tokens=num_output_tokens, finished_at=_now(at))

    def cancelled(self, request_id: str, *, num_output_tokens: int | None = None, at: float | None = None) -> None:
        self.update(request_id, status=RecordStatus.CANCELLED, finish_reason=FinishReason.ABORT,
                    num_output_tokens=num_output_tokens, finished_at=_now(at))

    async def written(self, request_id: str, timeout_s: float) -> bool:
        """Waits until every change made so far to `request_id`'s record is in Redis, at most
        timeout_s; True if it is. Writes it now rather than after the batching interval. Answers
        False at once while Redis is failing: a caller that must not show a client something before
        the record says it (the scheduler's first and last message of a stream) waits for a healthy
        Redis only, never for an absent one (invariant 6)."""
        if request_id in self._pending:
            waiters = self._pending_waiters
        elif any(update.request_id == request_id for update in self._batch):
            waiters = self._batch_waiters
        else:
            return True
        if not self._healthy or self._closing or timeout_s <= 0:
            return False
        done = asyncio.get_running_loop().create_future()
        waiters.setdefault(request_id, []).append(done)
        self._batch_full_event.set()  # a client waits on it: skip the coalescing interval
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout_s)
            return True
        except TimeoutError:
            return False

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def stats(self) -> WriterStats:
        return WriterStats(
            healthy=self._healthy,
            writes=self._writes,
            batches=self._batches,
            failures=self._failures,
            dropped=self._dropped,
            rejected=self._rejected,
            invalid=self._invalid,
            pending=len(self._pending) + len(self._batch),
        )

    def _ignore_invalid(self, request_id: str, reason: str) -> None:
        self._invalid += 1
        if reason not in self._logged_invalid:  # once per distinct mistake, not once per event
            self._logged_invalid.add(reason)
            logger.error("request state update for %r ignored: %s", request_id, reason)

    def _drop_oldest(self) -> None:
        if self._batch and not self._sending:
            self._batch.popleft()
        else:
            self._pending.popitem(last=False)
        self._dropped += 1
        if str(self._dropped).rstrip("0") == "1":  # at 1, 10, 100, ...: a long outage keeps saying so
            logger.warning("Redis away past max_pending=%d record changes: %d dropped so far, oldest first "
                           "(tokenmill:redis_writes_dropped_total)", self._max_pending, self._dropped)

    # ---- background side ----

    def start(self) -> None:
        """Start the background writer on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="request-state-writer")

    async def aclose(self) -> None:
        """Stop the background task and write what is pending, giving up after close_timeout_s."""
        if self._closing:
            return
        self._closing = True
        for event in (self._stop_event, self._has_work_event, self._batch_full_event):
            event.set()
        try:
            async with asyncio.timeout(self._close_timeout_s):
                if self._task is not None:
                    await self._task
                retry_s = self._retry_initial_s
                while self._pending or self._batch:
                    if not await self._write_batch():
                        await asyncio.sleep(retry_s)
                        retry_s = min(retry_s * 2, self._retry_max_s)
        except TimeoutError:
            pending = len(self._pending) + len(self._batch)
            logger.warning("request state writer closed with %d record changes unwritten", pending)
        finally:
            if self._task is not None and not self._task.done():
                self._task.cancel()
            await self._client.aclose()

    async def __aenter__(self) -> RequestStateWriter:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _run(self) -> None:
        retry_s = self._retry_initial_s
        while not self._closing:
            if not (self._pending or self._batch):
                self._has_work_event.clear()
                await self._has_work_event.wait()
                continue
            if not self._batch and len(self._pending) < self._batch_max:
                # let a burst of changes coalesce before writing
                await _wait(self._batch_full_event, self._flush_interval_s)
            self._batch_full_event.clear()
            if self._closing:
                return
            if await self._write_batch():
                retry_s = self._retry_initial_s
            else:
                await _wait(self._stop_event, retry_s)
                retry_s = min(retry_s * 2, self._retry_max_s)

    async def _write_batch(self) -> bool:
        """Write one batch; False if Redis could not be reached (the batch stays for the retry)."""
        if not self._batch:
            for _ in range(min(self._batch_max, len(self._pending))):
                update = self._pending.popitem(last=False)[1]
                update.write_id = self._write_id_prefix + str(next(self._write_seq))
                self._batch.append(update)
                if update.request_id in self._pending_waiters:
                    self._batch_waiters[update.request_id] = self._pending_waiters.pop(update.request_id)
        batch = list(self._batch)
        self._sending = True
        try:
            with self._causes.batch_span("kvstore.request_state.write"):  # linked to the steps behind it
                results = await self._send(batch)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failures += 1
            if self._healthy:
                logger.warning(
                    "Redis write failed, keeping %d record changes to retry: %s: %s",
                    len(batch), type(exc).__name__, exc,
                )
            self._healthy = False
            return False
        except Exception:  # not Redis: a batch that cannot even be encoded will never succeed
            logger.exception("request state batch of %d records dropped", len(batch))
            self._batch.clear()
            self._release_batch_waiters()
            self._failures += 1
            return True
        finally:
            self._sending = False
        self._batch.clear()
        self._release_batch_waiters()
        for result in results:
            if result is None:
                self._failures += 1
                continue
            applied, refused = result
            self._writes += applied
            self._rejected += int(not applied or refused > 0)
        self._batches += 1
        if not self._healthy:
            logger.info("Redis writes recovered")
        self._healthy = True
        return True

    async def _send(self, batch: list[RecordUpdate]) -> list[tuple[int, int] | None]:
        keys, args = script_args(batch, self._ttl_s)
        # one script call per batch: one round trip, like a pipeline, with far less client CPU;
        # redis-py reloads the script by itself after a Redis restart emptied its script cache
        results, first_error = parse_results(await self._script(keys=keys, args=args))
        if first_error is not None:
            logger.error("Redis refused %d records of a batch: %s", results.count(None), first_error)
        return results


    def _release_batch_waiters(self) -> None:
        for waiters in self._batch_waiters.values():
            for done in waiters:
                if not done.done():
                    done.set_result(None)
        self._batch_waiters.clear()


def _now(at: float | None) -> float:
    return time.time() if at is None else at


async def _wait(event: asyncio.Event, timeout_s: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        pass
