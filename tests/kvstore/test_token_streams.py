"""Token streams for resume against a real Redis: entries in order, read from any point, kept while
Redis is down and written in order once it is back."""
from __future__ import annotations

from core.outputs import FinishReason
from kvstore.token_streams import TokenStreamReader, TokenStreamWriter
from tests.kvstore.conftest import wait_until


async def read_all(reader: TokenStreamReader, request_id: str):
    after, entries = "0", []
    while True:
        after, more = await reader.read(request_id, after, block_ms=50)
        if not more:
            return entries
        entries += more


async def test_entries_come_back_in_order_with_their_indexes_and_the_finish(fresh_redis):
    writer, reader = TokenStreamWriter(fresh_redis), TokenStreamReader(fresh_redis)
    writer.start()
    try:
        writer.append("r1", 0, [5, 6])
        writer.append("r1", 2, [7])
        writer.finish("r1", 3, FinishReason.LENGTH, None, num_prompt_tokens=4)
        await wait_until(lambda: writer.pending == 0, what="the writer to flush")
        entries = await read_all(reader, "r1")
        assert [(e.index, e.token_ids, e.finish_reason) for e in entries] == [
            (0, [5, 6], None), (2, [7], None), (3, [], FinishReason.LENGTH)]
        assert entries[-1].num_prompt_tokens == 4 and await reader.exists("r1")
        assert not await reader.exists("never")
    finally:
        await writer.aclose()
        await reader.aclose()


async def test_redis_down_keeps_the_entries_and_they_land_in_order_after_the_restart(own_redis):
    writer = TokenStreamWriter(own_redis.url, retry_max_s=0.1)
    writer.start()
    own_redis.stop()
    for index in range(50):
        writer.append("r1", index, [index])
    writer.finish("r1", 50, FinishReason.STOP, None, num_prompt_tokens=1)
    await wait_until(lambda: not writer.healthy, what="the writer to notice Redis is down")
    own_redis.start()  # same port, empty
    await wait_until(lambda: writer.pending == 0, timeout_s=10, what="the writer to catch up")
    reader = TokenStreamReader(own_redis.url)
    try:
        entries = await read_all(reader, "r1")
    finally:
        await reader.aclose()
        await writer.aclose()
    assert [token for entry in entries for token in entry.token_ids] == list(range(50))
    assert entries[-1].finish_reason is FinishReason.STOP and writer.healthy and writer.dropped == 0


async def test_past_its_bound_a_writer_drops_the_oldest_and_counts_logs_and_exports_it(own_redis, caplog):
    from plumbing.telemetry.metrics import DroppedWritesCollector, model_name

    writer = TokenStreamWriter(own_redis.url, max_pending=5, retry_max_s=0.1)
    writer.start()
    own_redis.stop()
    try:
        with caplog.at_level("WARNING", logger="kvstore.token_streams"):
            for index in range(15):
                writer.append("r1", index, [index])
        assert writer.dropped >= 10 - 1  # one batch may be in flight (kept for its retry)
        assert any("dropped so far" in record.getMessage() for record in caplog.records)
        collected = list(DroppedWritesCollector(lambda: {"token_stream": writer.dropped}).collect())
        assert [(s.name, s.labels, s.value) for s in collected[0].samples] == [
            ("tokenmill:redis_writes_dropped_total", {"model_name": model_name(), "kind": "token_stream"},
             float(writer.dropped))]
    finally:
        own_redis.start()
        await writer.aclose()


async def command_calls(client) -> dict[str, int]:
    """Redis's own count of each command's calls (INFO commandstats), commands inside scripts included."""
    return {name.removeprefix("cmdstat_"): stats["calls"] for name, stats in (await client.info("commandstats")).items()}


async def test_a_flush_of_300_requests_is_one_script_call_and_odd_error_text_survives(fresh_redis):
    """One command per flush, not an XADD + EXPIRE per request (issue 33): Redis counts one EVALSHA
    (and its XADDs inside the script), and the client one round trip."""
    from core.errors import DeadlineExceeded
    from kvstore.client import connect

    client, reader = connect(fresh_redis), TokenStreamReader(fresh_redis)
    writer = TokenStreamWriter(fresh_redis, flush_interval_s=0.05)
    message = 'past "its" deadline\nafter 3 tokens: ünïcode, \\ and ]}'
    try:
        await client.config_resetstat()
        for request in range(300):
            writer.append(f"r{request}", 0, [request, request + 1])
        writer.finish("r7", 2, FinishReason.ABORT, DeadlineExceeded(message), num_prompt_tokens=3)
        writer.start()
        await wait_until(lambda: writer.pending == 0, what="the writer to flush")
        calls = await command_calls(client)
        assert writer.round_trips == 1 and calls.get("evalsha", 0) + calls.get("eval", 0) == 1
        assert calls["xadd"] == 301 and calls["expire"] == 301
        entries = await read_all(reader, "r7")
        assert [(e.index, e.token_ids) for e in entries] == [(0, [7, 8]), (2, [])]
        assert isinstance(entries[-1].error, DeadlineExceeded) and str(entries[-1].error) == message
        assert (await read_all(reader, "r299"))[0].token_ids == [299, 300]
    finally:
        await writer.aclose()
        await reader.aclose()
        await client.aclose()


async def test_round_trips_per_step_are_exported_by_writer(fresh_redis):
    from plumbing.telemetry.metrics import RedisRoundTripsCollector

    writer = TokenStreamWriter(fresh_redis, flush_interval_s=0.05)
    try:
        for request in range(64):
            writer.append(f"r{request}", 0, [request])
        writer.start()
        await wait_until(lambda: writer.pending == 0, what="the writer to flush")
        collected = list(RedisRoundTripsCollector(lambda: {"token_stream": writer.round_trips}, lambda: 3).collect())
        assert [(s.name, s.labels, s.value) for family in collected for s in family.samples] == [
            ("tokenmill:redis_round_trips_total", {"kind": "token_stream"}, 1.0),
            ("tokenmill:scheduler_steps_total", {}, 3.0)]
    finally:
        await writer.aclose()


async def test_a_backlog_past_batch_max_goes_in_several_calls_in_order(own_redis):
    """After an outage the backlog is written batch_max entries per call, so no one call holds Redis long."""
    from kvstore.client import connect

    writer = TokenStreamWriter(own_redis.url, retry_max_s=0.1, batch_max=10)
    writer.start()
    own_redis.stop()
    for index in range(25):
        writer.append("r1", index, [index])
    await wait_until(lambda: not writer.healthy, what="the writer to notice Redis is down")
    own_redis.start()  # empty: its statistics count only what came after the restart
    await wait_until(lambda: writer.pending == 0, timeout_s=10, what="the writer to catch up")
    reader, client = TokenStreamReader(own_redis.url), connect(own_redis.url)
    try:
        entries = await read_all(reader, "r1")
        stats = (await client.info("commandstats"))["cmdstat_evalsha"]
    finally:
        await reader.aclose()
        await client.aclose()
        await writer.aclose()
    assert [token for entry in entries for token in entry.token_ids] == list(range(25))
    assert stats["calls"] - stats.get("failed_calls", 0) == 3, stats  # 10 + 10 + 5 (NOSCRIPT replies aside)
