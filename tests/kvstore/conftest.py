"""Writers and readers against the real Redis of tests/helpers/redis_server.py, closed after each test."""
from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.state_reader import RequestStateReader
from kvstore.state_writer import RequestStateWriter


async def wait_until(condition, timeout_s: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


async def drained(writer: RequestStateWriter, timeout_s: float = 5.0) -> None:
    """Wait until everything the writer holds has been written."""
    await wait_until(lambda: writer.stats.pending == 0, timeout_s, f"writer to drain ({writer.stats})")


@pytest.fixture
async def make_writer(fresh_redis):
    writers: list[RequestStateWriter] = []

    def factory(redis_url: str = fresh_redis, **options) -> RequestStateWriter:
        writer = RequestStateWriter(redis_url, **options)
        writer.start()
        writers.append(writer)
        return writer

    yield factory
    for writer in writers:
        await writer.aclose()


@pytest.fixture
async def reader(fresh_redis):
    async with RequestStateReader(fresh_redis) as state_reader:
        yield state_reader
