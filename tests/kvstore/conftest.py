"""Writers and readers against the real Redis of tests/helpers/redis_server.py, closed after each test."""
from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.records import RecordStatus, RequestRecord
from kvstore.state_reader import RequestStateReader
from kvstore.state_writer import RequestStateWriter


def timed_record(request_id: str, status: RecordStatus, **fields) -> RequestRecord:
    """A record with its counts, times, model and priority set (times to the nanosecond, so a lossy
    encoding shows); fields add or replace any."""
    values = dict(num_preemptions=2, num_prompt_tokens=17, num_output_tokens=5, created_at=1_700_000_000.123456789,
                  first_scheduled_at=1_700_000_000.25, first_token_at=1_700_000_000.5, model="smollm2-135m",
                  priority=-3)
    return RequestRecord(request_id=request_id, status=status, **{**values, **fields})


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
