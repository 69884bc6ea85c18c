"""The stream idle timeout (`--stream-idle-timeout-s`): a streaming call whose client stops reading.

gRPC flow control stops a server's writes once the client's window is full, so a client that holds a
stream open without reading blocks the write of its next message. Without a limit that call, its
request (and the request's KV pages while it still generates) and every message behind it stay held
for as long as the client keeps the connection, and keepalive cannot help: the client's transport
answers pings. Each write therefore gets `timeout_s`; one that cannot complete in that time ends the
call with StreamIdle (CANCELLED). The caller then cancels the request in the scheduler (closing the
generator frees its pages) and records why.

Writes go through context.write, not `yield`, because a handler suspended in `yield` cannot be woken
while gRPC waits on the window: cancelling its task leaves the call without a status, and the client
would wait for ever.
"""
from __future__ import annotations

import asyncio

import grpc

from core.errors import Cancelled


class StreamIdle(Cancelled):
    """The client read nothing for the idle timeout; CANCELLED, naming the flag."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"stream idle timeout: the client read nothing for {timeout_s:g}s "
                         f"(--stream-idle-timeout-s); the request is cancelled")


async def write_within(context: grpc.aio.ServicerContext, message: object, timeout_s: float) -> None:
    """context.write(message), raising StreamIdle if the client has not taken it within timeout_s
    (0: no limit)."""
    if timeout_s <= 0:
        await context.write(message)
        return
    try:
        async with asyncio.timeout(timeout_s):  # not wait_for: that makes a task per message
            await context.write(message)
    except TimeoutError:
        raise StreamIdle(timeout_s) from None
