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


async def write_within(write: Awaitable[object], timeout_s: float) -> None:
    """await write (context.write(message), response.write(data)), raising StreamIdle if the client
    has not taken it within timeout_s (0: no limit)."""
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
