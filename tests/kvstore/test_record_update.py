"""The Lua transition script against a real Redis: the rules hold whoever writes, in one atomic step."""
import redis.asyncio as redis_asyncio

from kvstore.record_update import UPDATE_RECORDS_LUA, RecordUpdate, parse_results, script_args
from kvstore.records import RecordStatus, record_key


async def apply_batch(client, updates: list[RecordUpdate], ttl_s: int = 60):
    keys, args = script_args(updates, ttl_s)
    return parse_results(await client.eval(UPDATE_RECORDS_LUA, len(keys), *keys, *args))


async def apply(client, update: RecordUpdate, ttl_s: int = 60) -> list[int]:
    [result], first_error = await apply_batch(client, [update], ttl_s)
    assert first_error is None
    return list(result)


def update_with(request_id: str, write_id: str, *statuses: str, **fields: str) -> RecordUpdate:
    update = RecordUpdate(request_id, write_id)
    for status in statuses:
        update.add_status(status)
    for name, value in fields.items():
        update.set_field(name, value)
    return update


def test_preemption_cycles_fold_into_a_short_path():
    update = RecordUpdate("r", "w:0")
    update.add_status("queued")
    for _ in range(1000):
        update.add_status("running")
        update.add_status("queued")
    update.add_status("running")
    update.add_status("finished")
    assert update.path == [["queued", 0], ["running", 1000], ["finished", 0]]


async def test_folded_path_counts_every_preemption_once_even_when_resent(fresh_redis):
    client = redis_asyncio.Redis.from_url(fresh_redis, decode_responses=True)
    update = update_with("r", "w:0", "queued", "running", "queued", "running", "queued", "running")
    assert await apply(client, update) == [1, 0]
    # the same update again, as after a pipeline that broke after Redis had run it
    assert await apply(client, update) == [1, 0]
    record = await client.hgetall(record_key("r"))
    assert record["status"] == "running" and record["num_preemptions"] == "2"
    # a new write that preempts once more from the stored "running"
    assert await apply(client, update_with("r", "w:1", "queued")) == [1, 0]
    assert await client.hget(record_key("r"), "num_preemptions") == "3"
    await client.aclose()


async def test_terminal_record_refuses_any_later_write(fresh_redis):
    client = redis_asyncio.Redis.from_url(fresh_redis, decode_responses=True)
    await apply(client, update_with("r", "a:0", "queued", "running"))
    await apply(client, update_with("r", "a:1", "finished", num_output_tokens="9", finish_reason="stop"))
    # a stale writer (another process, another batch) still thinks the request is running
    assert await apply(client, update_with("r", "b:0", "running", num_output_tokens="4")) == [0, 1]
    assert await apply(client, update_with("r", "b:1", num_output_tokens="5")) == [0, 0]
    record = await client.hgetall(record_key("r"))
    assert (record["status"], record["num_output_tokens"], record["finish_reason"]) == ("finished", "9", "stop")
    await client.aclose()


async def test_disallowed_transition_is_refused_but_record_stays_consistent(fresh_redis):
    client = redis_asyncio.Redis.from_url(fresh_redis, decode_responses=True)
    await apply(client, update_with("r", "a:0", "queued"))
    # queued -> finished skips running: refused, the status stays queued
    assert await apply(client, update_with("r", "a:1", "finished")) == [1, 1]
    assert await client.hget(record_key("r"), "status") == RecordStatus.QUEUED
    await client.aclose()


async def test_missing_record_needs_a_status_to_be_created(fresh_redis):
    client = redis_asyncio.Redis.from_url(fresh_redis, decode_responses=True)
    assert await apply(client, update_with("late", "a:0", num_output_tokens="3")) == [0, 0]
    assert not await client.exists(record_key("late"))
    # its queued write was lost (dropped while Redis was away): the record starts at "running"
    assert await apply(client, update_with("mid", "a:1", "running")) == [1, 0]
    assert await client.hget(record_key("mid"), "status") == "running"
    await client.aclose()


async def test_first_write_wins_for_first_timestamps(fresh_redis):
    client = redis_asyncio.Redis.from_url(fresh_redis, decode_responses=True)
    await apply(client, update_with("r", "a:0", "running", first_scheduled_at="1.5"))
    await apply(client, update_with("r", "a:1", "queued"))
    await apply(client, update_with("r", "a:2", "running", first_scheduled_at="9.5"))
    assert await client.hget(record_key("r"), "first_scheduled_at") == "1.5"
    await client.aclose()


async def test_one_bad_key_fails_only_its_own_record(fresh_redis):
    client = redis_asyncio.Redis.from_url(fresh_redis, decode_responses=True)
    await client.set(record_key("not-a-hash"), "something else")
    updates = [update_with(request_id, f"a:{request_id}", "queued") for request_id in ("r1", "not-a-hash", "r2")]
    results, first_error = await apply_batch(client, updates)
    assert results == [(1, 0), None, (1, 0)]
    assert "WRONGTYPE" in first_error
    assert await client.hget(record_key("r2"), "status") == "queued"
    await client.aclose()
