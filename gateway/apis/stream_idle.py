"""The stream idle timeout (`--stream-idle-timeout-s`): a streaming call whose client stops reading.

Flow control stops a server's writes once the client has stopped taking them (gRPC: the client's
HTTP/2 window is full; HTTP/1.1 server-sent events: the TCP window and the transport's write buffer
are), so a client that holds a stream open without reading blocks the write of its next message.
Without a limit that call, its request (and the request's KV pages while it still generates) and
every message behind it stay held for as long as the client keeps the connection, and keepalive
cannot help: the client's transport answers pings (and ACKs TCP's zero-window probes). Each write
therefore gets `timeout_s`; one that cannot complete in that time raises StreamIdle (CANCELLED). The
caller records why (record_idle), then cancels the request in the scheduler (closing the generator
frees its pages) and ends the call.

    with IdleWatchdog(timeout_s) as watchdog:     # one per stream, in the task that writes
        async for message in messages:
            await watchdog.write(context.write(message))      # StreamIdle when it hangs timeout_s

One timer per stream, not one per message (issue 33: a fresh asyncio.timeout around every write was the
gateway's largest cost at 256 streams): the watchdog notes when the write in flight began, and its timer,
armed once and re-armed only when it fires (about once per timeout_s), cancels the stream's task if
that write is still in flight timeout_s after it began; the write then raises StreamIdle, as
asyncio.timeout would have raised TimeoutError.

gRPC writes go through context.write, not `yield`, because a handler suspended in `yield` cannot be
woken while gRPC waits on the window: cancelling its task leaves the call without a status, and the
client would wait for ever.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable

from core.errors import Cancelled

logger = logging.getLogger(__name__)
RECORD_IDLE_WAIT_S = 1.0  # an idle stream's requests are aborted after this even if Redis has not answered


class StreamIdle(Cancelled):
    """The client read nothing for the idle timeout; CANCELLED, naming the flag."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"stream idle timeout: the client read nothing for {timeout_s:g}s "
                         f"(--stream-idle-timeout-s); the request is cancelled")


class IdleWatchdog:
    """The idle timeout of one stream's writes, all made by the task that enters it (the docstring above)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # 0: no limit
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._write_began: float | None = None  # loop time the write in flight began; None: none in flight
        self._fired = False

    def __enter__(self) -> IdleWatchdog:
        if self.timeout_s > 0:
            self._task, self._loop = asyncio.current_task(), asyncio.get_running_loop()
            self._timer = self._loop.call_later(self.timeout_s, self._check)
        return self

    def __exit__(self, *exc_info) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def write(self, write: Awaitable[object]) -> None:
        """await write (context.write(message), response.write(data)); StreamIdle if the client has not
        taken it within timeout_s."""
        if self._loop is None:
            await write
            return
        self._write_began = self._loop.time()
        try:
            await write
        except asyncio.CancelledError:
            # the watchdog's own cancel (and no other one pending): the stream is idle
            if self._fired and self._task.uncancel() == 0:
                raise StreamIdle(self.timeout_s) from None
            raise
        finally:
            self._write_began = None

    def _check(self) -> None:
        now, began = self._loop.time(), self._write_began
        if began is not None and now - began >= self.timeout_s:
            self._fired, self._timer = True, None
            self._task.cancel()
            return
        # next: when the write in flight would have hung timeout_s, else timeout_s from now
        self._timer = self._loop.call_at((began if began is not None else now) + self.timeout_s, self._check)


async def write_within(write: Awaitable[object], timeout_s: float) -> None:
    """await write, raising StreamIdle if the client has not taken it within timeout_s (0: no limit):
    for a write outside a stream's loop (a last event while the gateway shuts down); a stream's own
    writes go through its IdleWatchdog."""
    if timeout_s <= 0:
        await write
        return
    try:
        async with asyncio.timeout(timeout_s):  # not wait_for: that makes a task per message
            await write
    except TimeoutError:
        raise StreamIdle(timeout_s) from None


async def record_idle(state_reader, request_ids: Iterable[str], error: StreamIdle) -> None:
    """Ends the records of an idle stream's requests failed, with error as the reason. Call it before
    the requests are aborted: a cancel written first would be their end state, without the reason.
    state_reader: kvstore.RequestStateReader, or None without Redis (nothing to record)."""
    request_ids = list(request_ids)
    if state_reader is None or not request_ids:
        return
    try:
        await asyncio.wait_for(state_reader.mark_orphans_failed(request_ids, error), RECORD_IDLE_WAIT_S)
    except Exception as exc:  # noqa: BLE001 - Redis away or slow: the records end "cancelled", without why
        logger.warning("could not record the idle timeout of %r: %r", request_ids, exc)
