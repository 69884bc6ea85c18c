"""The gateway's router against real parts: two gRPC servers answering grpc.health.v1 as schedulers,
their LoadReporters publishing real prefix caches to a real Redis, and DNS resolution."""
from __future__ import annotations

import asyncio

import pytest

from gateway.upstream.circuit_breaker import CircuitBreaker
from gateway.generation.context import CallContext, SchedulerSide
from gateway.generation.stream import stream_generation
from gateway.upstream.replica_router import ReplicaRouter, resolve_all
from gateway.prepare.request_builder import PreparedRequest
from gateway.text.tokenizer import load_tokenizer
from scheduler.process.load_report import LoadReporter
from scheduler.process.loop import EngineLoop
from tests.helpers.tiny_models import write_tiny_tokenizer
from tests.scheduler.conftest import make_engine, make_request
from plumbing import rpc
from core.errors import Unavailable


async def _health_server(ready: bool):
    server = rpc.create_server()
    health = rpc.add_health_and_reflection(server, [rpc.SCHEDULER_SERVICE])
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    await health.set_ready(ready)
    return server, address


async def test_routes_by_the_prefixes_each_replica_published(fresh_redis):
    servers = [await _health_server(True), await _health_server(True), await _health_server(False)]
    addresses = [address for _, address in servers]
    prompts = [list(range(10, 22)), list(range(50, 62))]  # 3 full pages of 4 each
    reporters = []
    for address, prompt in zip(addresses, prompts):
        engine = make_engine(block_size=4)
        engine.run_to_completion([make_request(prompt, max_tokens=1)])
        reporter = LoadReporter(fresh_redis, address, EngineLoop(engine.scheduler, executor=None))
        await reporter.publish_once()
        reporters.append(reporter)
    router = ReplicaRouter(addresses, redis_url=fresh_redis)
    router.block_size = 4  # what wait_ready takes from the model info
    try:
        await router.refresh()
        assert [r.ready for r in router.replicas.values()] == [True, True, False]
        for _ in range(3):  # each prompt's own replica, every time, whatever the rotation
            assert router.choose(prompts[1] + [7, 8]).address == addresses[1]
            assert router.choose(prompts[0] + [9]).address == addresses[0]
        # distinct prompts held nowhere: both ready replicas take turns; the not-ready one gets none
        chosen = {router.choose([200 + i] * 5).address for i in range(4)}
        assert chosen == set(addresses[:2])
        # a prompt just sent somewhere counts as held there until the reports catch up
        first = router.choose([300] * 8).address
        assert all(router.choose([300] * 8 + [i]).address == first for i in range(4))
    finally:
        await router.close()
        for reporter in reporters:
            await reporter.aclose()
        for server, _ in servers:
            await server.stop(None)


async def test_no_ready_replica_is_unavailable_naming_them():
    server, address = await _health_server(False)
    router = ReplicaRouter([address])
    try:
        await router.refresh()
        with pytest.raises(Unavailable, match=address):
            router.choose([1, 2, 3])
    finally:
        await router.close()
        await server.stop(None)


async def test_a_request_the_router_refuses_at_once_takes_no_probe(tmp_path):
    # route() raises before any breaker is asked; a half-open breaker must still be able to probe after
    write_tiny_tokenizer(tmp_path)
    server, address = await _health_server(False)
    router = ReplicaRouter([address])
    breaker = router.replicas[address].client.breaker = CircuitBreaker("one replica", failure_threshold=1, open_s=0.01)
    try:
        await router.refresh()
        breaker.record_failure()
        await asyncio.sleep(0.05)  # open_s passed: the next call is the probe
        prepared = PreparedRequest(make_request([1, 2, 3], max_tokens=2), [])
        with pytest.raises(Unavailable, match=address):
            async for _ in stream_generation(prepared, CallContext(0.0), SchedulerSide(load_tokenizer(tmp_path), router)):
                pass
        assert breaker.before_call()  # probing again, not "circuit open"
    finally:
        await router.close()
        await server.stop(None)


async def test_a_dead_replica_opens_only_its_own_breaker_and_the_others_keep_serving(tmp_path):
    """One replica dies with calls on it: its failures open its breaker only; requests then go to the
    live replica instead of being refused for everyone (one shared breaker refused them all)."""
    write_tiny_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    live_server, live = await _health_server(True)
    dead_server, dead = await _health_server(True)
    router = ReplicaRouter([live, dead])
    try:
        await router.refresh()
        await dead_server.stop(None)  # still "ready" until the next refresh: calls routed there fail
        for replica in router.replicas.values():
            replica.client.breaker = CircuitBreaker(replica.address, failure_threshold=2, open_s=60.0)
        dead_breaker = router.replicas[dead].client.breaker
        failures = 0
        for i in range(12):  # distinct prompts: the rotation sends about half to the dead replica
            prepared = PreparedRequest(make_request([100 + i] * 3, max_tokens=2), [])
            with pytest.raises(Exception) as caught:  # the live one is a health server only: UNIMPLEMENTED
                async for _ in stream_generation(prepared, CallContext(0.0), SchedulerSide(tokenizer, router)):
                    pass
            if isinstance(caught.value, Unavailable):
                assert dead in str(caught.value)
                failures += 1
        assert failures == 2  # after two, the dead replica's breaker is open and it is no longer chosen
        assert not dead_breaker.can_call()
        assert router.replicas[live].client.breaker.can_call()
        assert all(router.choose([200 + i] * 3).address == live for i in range(6))
    finally:
        await router.close()
        await live_server.stop(None)


async def test_dns_name_resolves_to_every_address():
    assert "127.0.0.1:50052" in await resolve_all("localhost:50052")
    with pytest.raises(ValueError, match="HOST:PORT"):
        await resolve_all("localhost")


def test_the_router_imports_without_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import gateway.upstream.replica_router, gateway.main, core.prefix_keys\n"
            "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "ok\n", result.stderr
