"""The replica's report in a real Redis: load counters, and the prefix set following the KV cache
as pages are cached and evicted (the keys gateways route by)."""
from __future__ import annotations

import redis

from kvstore.replica_keys import LOAD_FIELDS, LOAD_TTL_S, load_key, prefixes_key
from scheduler.process.load_report import LoadReporter
from scheduler.process.loop import EngineLoop
from core.prefix_keys import extend_block_hashes
from tests.scheduler.conftest import make_engine, make_request

REPLICA = "10.0.0.7:50052"


def _keys(tokens, block_size=4) -> set[str]:
    keys: list[bytes] = []
    extend_block_hashes(keys, tokens, block_size)
    return {key.hex() for key in keys}


async def test_report_follows_the_prefix_cache_through_eviction(fresh_redis):
    engine = make_engine(num_blocks=6, block_size=4)
    loop = EngineLoop(engine.scheduler, executor=None)  # never started: the reporter only reads
    reporter = LoadReporter(fresh_redis, REPLICA, loop)
    store = redis.Redis.from_url(fresh_redis, decode_responses=True)
    first = list(range(10, 22))  # 3 full pages
    engine.run_to_completion([make_request(first, max_tokens=1)])
    await reporter.publish_once()
    assert _keys(first) <= store.smembers(prefixes_key(REPLICA))
    report = store.hgetall(load_key(REPLICA))
    assert report["num_kv_pages_total"] == "6" and report["num_waiting_requests"] == "0"
    assert 0 < store.ttl(load_key(REPLICA)) <= LOAD_TTL_S
    assert set(report) == set(LOAD_FIELDS)
    version = report["prefix_version"]

    # a prompt filling all 6 pages evicts every page of the first one
    second = list(range(100, 122))
    engine.run_to_completion([make_request(second, max_tokens=1)])
    await reporter.publish_once()
    published = store.smembers(prefixes_key(REPLICA))
    assert _keys(second) <= published
    assert not _keys(first) & published, "evicted pages must leave the published set"
    assert published == {key.hex() for key in engine.scheduler.kv.pool.cached_keys()}
    assert store.hget(load_key(REPLICA), "prefix_version") != version

    version = store.hget(load_key(REPLICA), "prefix_version")
    await reporter.publish_once()  # nothing changed: same version, so gateways skip re-reading
    assert store.hget(load_key(REPLICA), "prefix_version") == version
    await reporter.aclose()  # a replica that stops leaves at once instead of when its keys expire
    assert not store.exists(load_key(REPLICA), prefixes_key(REPLICA))
