"""The live-request hash and the streamed-token read a restarted scheduler re-admits from, against a
real Redis (tests/helpers/redis_server.py)."""
from __future__ import annotations

from core.outputs import FinishReason
from kvstore.live_requests import LiveRequestReader, LiveRequestWriter
from kvstore.token_streams import TokenStreamWriter
from tests.kvstore.conftest import wait_until


async def test_admitted_until_ended_and_streamed_tokens_in_order_without_repeats(fresh_redis):
    live, tokens = LiveRequestWriter(fresh_redis, "127.0.0.1:9"), TokenStreamWriter(fresh_redis)
    reader = LiveRequestReader(fresh_redis, "127.0.0.1:9")
    live.start()
    tokens.start()
    try:
        live.admitted("a", "submitted-a")
        live.admitted("b", "submitted-b")
        live.ended("b")
        tokens.append("a", 0, [5, 6])
        tokens.append("a", 0, [5, 6])  # a resent batch repeats an entry
        tokens.append("a", 2, [7])
        await wait_until(lambda: live.pending == 0 and tokens.pending == 0, what="writes")
        assert await reader.live() == {"a": "submitted-a"}  # another scheduler id sees none of it
        assert await LiveRequestReader(fresh_redis, "127.0.0.1:10").live() == {}
        assert await reader.streamed("a") == ([5, 6, 7], None)
        tokens.finish("a", 3, FinishReason.LENGTH, None, 4)
        await wait_until(lambda: tokens.pending == 0, what="the finish entry")
        assert await reader.streamed("a") == ([5, 6, 7], FinishReason.LENGTH)
    finally:
        await live.aclose()
        await tokens.aclose()
        await reader.aclose()


async def test_a_flush_is_one_round_trip_of_three_commands_however_many_requests_changed(fresh_redis):
    from kvstore.client import connect

    client, live = connect(fresh_redis), LiveRequestWriter(fresh_redis, "127.0.0.1:9", flush_interval_s=0.05)
    reader = LiveRequestReader(fresh_redis, "127.0.0.1:9")
    try:
        await client.config_resetstat()
        for request in range(200):
            live.admitted(f"r{request}", f"submitted-{request}")
        for request in range(0, 200, 2):  # half of them end within the same batch
            live.ended(f"r{request}")
        live.admitted("r0", "submitted-again")  # the last change of a request wins
        live.start()
        await wait_until(lambda: live.pending == 0, what="writes")
        stats = await client.info("commandstats")
        assert live.round_trips == 1
        assert {name: stats[f"cmdstat_{name}"]["calls"] for name in ("hset", "hdel", "expire")} == {
            "hset": 1, "hdel": 1, "expire": 1}
        assert await reader.live() == {"r0": "submitted-again"} | {
            f"r{request}": f"submitted-{request}" for request in range(1, 200, 2)}
    finally:
        await live.aclose()
        await reader.aclose()
        await client.aclose()


async def test_an_admission_says_when_it_is_in_redis(fresh_redis):
    """The future admitted() returns is done once a flush has written the submission, not before: the
    scheduler sends a resumable request's first output only then (scheduler.process.request_streams)."""
    live = LiveRequestWriter(fresh_redis, "127.0.0.1:9", flush_interval_s=0.05)
    reader = LiveRequestReader(fresh_redis, "127.0.0.1:9")
    try:
        kept = live.admitted("a", "submitted-a")
        assert not kept.done() and await reader.live() == {}
        live.start()
        await kept
        assert await reader.live() == {"a": "submitted-a"}
    finally:
        await live.aclose()
        await reader.aclose()
