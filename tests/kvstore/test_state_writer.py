"""RequestStateWriter against a real redis-server: batching, TTL, terminal states, outages."""
from core.outputs import FinishReason
import asyncio
import time

import redis

from kvstore.records import RecordStatus, record_key
from kvstore.state_reader import RequestStateReader
from kvstore.state_writer import RequestStateWriter
from tests.kvstore.conftest import drained, wait_until


async def test_lifecycle_lands_in_the_hash_with_preemptions_counted(make_writer, reader):
    writer = make_writer()
    writer.queued("r1", num_prompt_tokens=12, model="smollm2", priority=2, created_at=100.0)
    await drained(writer)
    writer.running("r1", at=101.0)
    writer.progress("r1", num_output_tokens=1, at=101.5)
    await drained(writer)  # the preemption below is checked by the server against stored "running"
    writer.preempted("r1")
    await drained(writer)
    writer.running("r1", at=103.0)  # resumed: first_scheduled_at must stay 101
    writer.preempted("r1")  # and a second preemption inside one batch
    writer.running("r1", at=104.0)
    writer.progress("r1", num_output_tokens=7, at=105.0)
    writer.finished("r1", finish_reason=FinishReason.LENGTH, at=106.0)
    await drained(writer)

    record = await reader.get_record("r1")
    assert record.status == RecordStatus.FINISHED
    assert record.num_preemptions == 2
    assert (record.num_prompt_tokens, record.num_output_tokens) == (12, 7)
    assert (record.created_at, record.first_scheduled_at, record.first_token_at) == (100.0, 101.0, 101.5)
    assert (record.finished_at, record.finish_reason) == (106.0, FinishReason.LENGTH)
    assert (record.model, record.priority) == ("smollm2", 2)
    assert writer.stats.rejected == 0 and writer.stats.failures == 0


async def test_updates_to_few_requests_coalesce_into_one_pipeline(make_writer, reader):
    writer = make_writer()
    for request_index in range(10):
        writer.queued(f"r{request_index}", num_prompt_tokens=4)
        writer.running(f"r{request_index}")
        for num_output_tokens in range(1, 99):
            writer.progress(f"r{request_index}", num_output_tokens=num_output_tokens)
    await drained(writer)
    assert (writer.stats.batches, writer.stats.writes) == (1, 10)
    assert (await reader.get_record("r3")).num_output_tokens == 98


async def test_many_requests_are_written_in_batches_of_batch_max(make_writer, fresh_redis):
    writer = make_writer(batch_max=256)
    for request_index in range(1000):
        writer.queued(f"r{request_index}")
    await drained(writer)
    assert (writer.stats.batches, writer.stats.writes) == (4, 1000)
    with redis.Redis.from_url(fresh_redis) as client:
        assert client.dbsize() == 1000


async def test_every_written_record_gets_the_ttl(make_writer, fresh_redis):
    writer = make_writer(ttl_s=120)
    writer.queued("r1")
    writer.queued("r2")
    await drained(writer)
    writer.running("r2")  # a later write refreshes, never removes, the TTL
    await drained(writer)
    with redis.Redis.from_url(fresh_redis) as client:
        for request_id in ("r1", "r2"):
            assert 0 < client.ttl(record_key(request_id)) <= 120


async def test_late_running_does_not_overwrite_finished(make_writer, reader):
    writer = make_writer()
    writer.queued("same-batch")
    writer.running("same-batch")
    writer.finished("same-batch", num_output_tokens=5)
    writer.running("same-batch")
    writer.progress("same-batch", num_output_tokens=2)
    writer.queued("later-batch")
    writer.running("later-batch")
    writer.finished("later-batch", num_output_tokens=6)
    await drained(writer)
    # the late write reaches Redis on its own: only the server can refuse it
    writer.running("later-batch")
    await drained(writer)
    # another writer (a stale process) writes late too
    stale_writer = make_writer()
    stale_writer.progress("later-batch", num_output_tokens=1)
    await drained(stale_writer)

    for request_id, num_output_tokens in (("same-batch", 5), ("later-batch", 6)):
        record = await reader.get_record(request_id)
        assert record.status == RecordStatus.FINISHED
        assert record.num_output_tokens == num_output_tokens
    assert writer.stats.rejected == 3  # two refused in memory, one by the server
    assert stale_writer.stats.rejected == 1


async def test_invalid_update_is_counted_not_raised(make_writer, reader):
    writer = make_writer()
    writer.update("r1", status="exploded")
    writer.update("r1", num_output_tokens="many")
    writer.update("r1", num_preemptions=4)  # only the server counts preemptions
    writer.queued("r1")
    await drained(writer)
    assert writer.stats.invalid == 3
    assert (await reader.get_record("r1")).status == RecordStatus.QUEUED


async def test_a_key_of_another_type_fails_only_its_record(make_writer, reader, fresh_redis):
    with redis.Redis.from_url(fresh_redis) as client:
        client.set(record_key("clobbered"), "not a hash")
    writer = make_writer()
    for request_id in ("r1", "clobbered", "r2"):
        writer.queued(request_id)
    await drained(writer)
    assert (writer.stats.writes, writer.stats.failures, writer.stats.batches) == (2, 1, 1)
    assert writer.healthy  # Redis answered; the record is the problem, not the connection
    assert (await reader.get_record("r2")).status == RecordStatus.QUEUED


async def test_aclose_writes_what_is_pending(fresh_redis, reader):
    writer = RequestStateWriter(fresh_redis, flush_interval_s=60.0)
    writer.start()
    writer.queued("r1")
    await asyncio.sleep(0)  # the writer is now waiting out its 60 s coalescing window
    await writer.aclose()
    assert (await reader.get_record("r1")).status == RecordStatus.QUEUED


async def test_redis_down_never_blocks_callers_and_pending_records_land_after_restart(own_redis):
    writer = RequestStateWriter(own_redis.url, retry_max_s=0.1)
    writer.start()
    writer.queued("before")
    await drained(writer)
    own_redis.stop()

    started = time.perf_counter()
    for request_index in range(10_000):
        writer.queued(f"r{request_index}", num_prompt_tokens=3)
    elapsed_s = time.perf_counter() - started
    # ~0.1 s on an idle machine; the bound leaves room for a busy one. (A call that waited on the
    # network would stall the hung-Redis test below by its socket timeout.)
    assert elapsed_s < 1.0, f"10k update calls took {elapsed_s:.3f}s while Redis was down"
    print(f"10k update calls while Redis was down: {elapsed_s * 1000:.1f} ms")
    for request_index in range(10_000):
        writer.running(f"r{request_index}")

    await wait_until(lambda: not writer.healthy, what="healthy to go False")
    assert writer.stats.failures >= 1 and writer.stats.pending == 10_000
    own_redis.start()  # same port
    await drained(writer, timeout_s=10.0)
    assert writer.healthy and writer.stats.dropped == 0

    async with RequestStateReader(own_redis.url) as reader:
        assert (await reader.get_record("r9999")).status == RecordStatus.RUNNING
    with redis.Redis.from_url(own_redis.url) as client:
        assert client.dbsize() == 10_000  # "before" went with the restart: no persistence
    await writer.aclose()


async def test_drops_oldest_past_max_pending_and_counts_them(own_redis):
    writer = RequestStateWriter(own_redis.url, max_pending=100, batch_max=32, retry_max_s=0.1)
    writer.start()
    own_redis.stop()
    for request_index in range(150):
        writer.queued(f"r{request_index}")
    assert (writer.stats.dropped, writer.stats.pending) == (50, 100)
    await wait_until(lambda: not writer.healthy, what="healthy to go False")
    writer.queued("r150")  # the retry batch is the oldest now, so it loses its head
    assert (writer.stats.dropped, writer.stats.pending) == (51, 100)

    own_redis.start()
    await drained(writer)
    with redis.Redis.from_url(own_redis.url) as client:
        assert client.dbsize() == 100
        assert not client.exists(record_key("r50"))
        assert client.exists(record_key("r51")) and client.exists(record_key("r150"))
    await writer.aclose()


async def test_hung_redis_does_not_stall_the_event_loop():
    """A Redis that accepts connections and never answers: only bookkeeping may suffer."""
    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never reply

    black_hole = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = black_hole.sockets[0].getsockname()[1]
    # A write that held the loop would hold it for the whole socket timeout. The bound below is half
    # of it: far above what a loaded 2-core machine adds to a 5 ms sleep, far below the stall it catches.
    socket_timeout_s = 2.0
    writer = RequestStateWriter(f"redis://127.0.0.1:{port}/0", socket_timeout_s=socket_timeout_s, close_timeout_s=0.5)
    writer.start()

    worst_gap_s, last = 0.0, time.perf_counter()
    started, deadline, num_output_tokens = last, last + socket_timeout_s + 3.0, 0
    # a stand-in scheduler loop (one step, one state event) until the writer's first write timed out
    while writer.healthy and time.perf_counter() < deadline:
        await asyncio.sleep(0.005)
        now = time.perf_counter()
        worst_gap_s, last = max(worst_gap_s, now - last), now
        num_output_tokens += 1
        writer.progress("r1", num_output_tokens=num_output_tokens)
    assert not writer.healthy and writer.stats.failures >= 1
    assert worst_gap_s < socket_timeout_s / 2, f"the loop stalled {worst_gap_s:.3f}s behind a hung Redis"
    assert last - started > socket_timeout_s * 0.9  # the loop stepped through the whole hung write

    started = time.perf_counter()
    await writer.aclose()  # gives up after close_timeout_s instead of hanging
    assert time.perf_counter() - started < 1.5
    black_hole.close()


async def test_owner_is_recorded_once_and_a_later_queued_cannot_change_it(make_writer, reader):
    writer = make_writer()
    writer.queued("r-owned", num_prompt_tokens=3, owner="alice")
    await drained(writer)
    writer.queued("r-owned", num_prompt_tokens=3, owner="mallory")  # a re-queue must not move the owner
    await drained(writer)
    assert (await reader.get_record("r-owned")).owner == "alice"
    writer.queued("r-anonymous", num_prompt_tokens=3)  # keys off: no owner field at all
    await drained(writer)
    assert (await reader.get_record("r-anonymous")).owner is None


async def test_written_returns_once_the_record_holds_the_change_without_waiting_out_the_batch_interval(
        make_writer, reader):
    writer = make_writer(flush_interval_s=5.0)  # a batch would otherwise wait 5 s to coalesce
    writer.queued("seen", num_prompt_tokens=3)
    started = time.monotonic()
    assert await writer.written("seen", timeout_s=2.0)
    assert time.monotonic() - started < 1.0
    assert (await reader.get_record("seen")).status == RecordStatus.QUEUED
    writer.cancelled("seen", num_output_tokens=5)  # a cancelled record keeps its true count
    assert await writer.written("seen", timeout_s=2.0)
    record = await reader.get_record("seen")
    assert (record.status, record.num_output_tokens) == (RecordStatus.CANCELLED, 5)
    assert await writer.written("never-changed", timeout_s=0.0)  # nothing pending: at once


async def test_written_does_not_wait_for_a_redis_that_is_failing(make_writer):
    # After the first failure the writer retries in 10 s, so a written() that waited for Redis (for
    # the retry, or out its own 5 s timeout) would take 5 s; the bound is a fifth of that, room for a
    # loaded machine, and a fast False is the only way to meet it.
    writer = make_writer("redis://127.0.0.1:1/0", socket_timeout_s=0.2, flush_interval_s=0.0,
                         retry_initial_s=10.0, retry_max_s=10.0)
    writer.queued("lost", num_prompt_tokens=3)
    await wait_until(lambda: not writer.healthy, 5.0, "the writer noticing Redis is away")
    writer.running("lost")
    started = time.monotonic()
    assert not await writer.written("lost", timeout_s=5.0)
    assert time.monotonic() - started < 1.0, "invariant 6: nothing waits on an absent Redis"
