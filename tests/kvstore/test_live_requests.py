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
