"""The stream idle timeout's watchdog (gateway.apis.stream_idle.IdleWatchdog): one timer per stream, not one
per write, that still cuts a write its client does not take within the timeout. The whole behaviour through
real gRPC and HTTP clients that stop reading: tests/e2e/test_fault_recovery.py."""
from __future__ import annotations

import asyncio
import time

import pytest

from gateway.apis.stream_idle import IdleWatchdog, StreamIdle

TIMEOUT_S = 0.2


async def written(delay_s: float) -> None:
    await asyncio.sleep(delay_s)


async def test_a_write_the_client_never_takes_raises_stream_idle_after_the_timeout():
    started = time.monotonic()
    with IdleWatchdog(TIMEOUT_S) as watchdog, pytest.raises(StreamIdle, match="--stream-idle-timeout-s"):
        await watchdog.write(written(0.01))
        await watchdog.write(asyncio.get_running_loop().create_future())  # never completes
    assert TIMEOUT_S <= time.monotonic() - started < TIMEOUT_S + 0.5
    assert not asyncio.current_task().cancelling()  # the watchdog's cancel is taken back


async def test_a_stream_longer_than_the_timeout_whose_writes_each_complete_is_not_idle():
    loop = asyncio.get_running_loop()
    with IdleWatchdog(TIMEOUT_S) as watchdog:
        until = loop.time() + 3 * TIMEOUT_S
        while loop.time() < until:  # each write takes most of the timeout, the stream three timeouts
            await watchdog.write(written(TIMEOUT_S * 0.7))
        await asyncio.sleep(2 * TIMEOUT_S)  # no write in flight: waiting on the scheduler is not idle


async def test_a_cancel_from_elsewhere_stays_a_cancel():
    async def stream() -> None:
        with IdleWatchdog(TIMEOUT_S) as watchdog:
            await watchdog.write(asyncio.get_running_loop().create_future())

    task = asyncio.create_task(stream())
    await asyncio.sleep(0.02)
    task.cancel()  # the client went away
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_no_timeout_never_cuts():
    with IdleWatchdog(0) as watchdog:
        await watchdog.write(written(0.05))
