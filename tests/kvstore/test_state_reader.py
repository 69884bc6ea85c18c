"""RequestStateReader against a real redis-server: reads and the clean-up after a scheduler restart."""
import redis

from core.errors import ErrorCode, Unavailable
from core.outputs import FinishReason
from kvstore.records import RecordStatus, RequestRecord, record_key
from tests.kvstore.conftest import drained, timed_record


async def test_get_record_round_trips_what_was_stored(reader, fresh_redis):
    record = timed_record("r1", RecordStatus.RUNNING)
    with redis.Redis.from_url(fresh_redis) as client:
        client.hset(record_key("r1"), mapping=record.to_mapping())
    assert await reader.get_record("r1") == record
    assert await reader.get_record("never-seen") is None


async def test_mark_orphans_failed_only_ends_live_records(make_writer, reader, fresh_redis):
    writer = make_writer(ttl_s=300)
    writer.queued("waiting")
    writer.queued("running")
    writer.running("running")
    writer.queued("done")
    writer.running("done")
    writer.finished("done", num_output_tokens=3)
    writer.queued("cancelled")
    writer.cancelled("cancelled")
    await drained(writer)

    ids = ["waiting", "running", "done", "cancelled", "unknown"]
    marked = await reader.mark_orphans_failed(ids, Unavailable("scheduler restarted"), at=1_800_000_000.0)

    assert marked == ["waiting", "running"]
    for request_id in marked:
        record = await reader.get_record(request_id)
        assert (record.status, record.error) == (RecordStatus.FAILED, "scheduler restarted")
        assert (record.finish_reason, record.finished_at) == (FinishReason.ERROR, 1_800_000_000.0)
        assert record.error_code is ErrorCode.UNAVAILABLE
    done = await reader.get_record("done")
    assert (done.status, done.error, done.num_output_tokens) == (RecordStatus.FINISHED, None, 3)
    assert (await reader.get_record("cancelled")).status == RecordStatus.CANCELLED
    assert await reader.get_record("unknown") is None  # clean-up never invents records
    with redis.Redis.from_url(fresh_redis) as client:
        assert 0 < client.ttl(record_key("waiting")) <= 3600


async def test_mark_orphans_failed_with_no_ids(reader):
    assert await reader.mark_orphans_failed([], Unavailable("scheduler restarted")) == []


async def test_mark_orphans_failed_over_many_script_calls(make_writer, reader):
    writer = make_writer()
    for request_index in range(0, 2100, 2):  # every other id has a live record
        writer.queued(f"r{request_index}")
    await drained(writer)
    marked = await reader.mark_orphans_failed([f"r{i}" for i in range(2100)], Unavailable("scheduler restarted"))
    assert marked == [f"r{i}" for i in range(0, 2100, 2)]
    assert (await reader.get_record("r2098")).status == RecordStatus.FAILED
