"""Faults on a real cluster (tiny random model): deadlines, cancellation, a worker killed with -9
mid-generation, the scheduler killed with -9, Redis stopped, the gateway restarted mid-stream,
SIGTERM drain. One cluster for the module; each test leaves it serving (the supervisor restarts what
a test kills) and waits for that before it ends."""
from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
import time

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.redis_health import REDIS_HEALTH_SERVICE
from protos.tokenmill.v1 import (common_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2, scheduler_pb2,
                                 scheduler_pb2_grpc)
from tokenmill.cluster.child_process import ChildSpec
from tokenmill.cluster.readiness import free_port
from tokenmill.cluster.supervisor import Supervisor
from tests.e2e.faults_cluster import (cluster_log_on_failure, generate_ok, kill9, request,  # noqa: F401 (a fixture)
                                      scheduler_load, tiny_cluster, wait_until)
from plumbing.rpc import GENERATION_SERVICE, SCHEDULER_SERVICE

pytestmark = pytest.mark.slow

LONG = 300  # tokens: a few seconds of decoding on a loaded CPU, so a fault lands mid-generation


@pytest.fixture(scope="module")
def cluster_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def cluster(cluster_dir):
    with tiny_cluster(cluster_dir) as running:
        yield running


async def collect(call) -> tuple[list[int], generation_pb2.GenerateStreamResponse | None]:
    ids, last = [], None
    async for message in call:
        ids += message.token_ids
        last = message
    return ids, last


async def test_deadline_in_the_queue_and_mid_generation_ends_with_deadline_exceeded_and_frees_pages(cluster):
    config, _ = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # mid-generation: 480 tokens take ~1 s or more (the tiny model's step is mostly the hops' and the
        # scheduler's ~2 ms), the first ones arrive within milliseconds
        call = stub.GenerateStream(request("deadline", 480, "deadline-mid"), timeout=0.4)
        received = []
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for message in call:
                received += message.token_ids
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0 < len(received) < 480
    # in the queue: straight to the scheduler, with a deadline that has passed by the time the loop
    # picks the request up (no gRPC deadline on the call: the scheduler's own check must end it)
    submit = scheduler_pb2.SubmitRequest(request_id="deadline-queued", prompt_token_ids=[65, 66, 67],
                                         sampling_params=sampling_pb2.SamplingParams(max_tokens=LONG, temperature=0.0))
    submit.deadline.FromNanoseconds(time.time_ns())
    async with grpc.aio.insecure_channel(config.scheduler_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in scheduler_pb2_grpc.SchedulerStub(channel).Submit(submit, timeout=60):
                pass
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "passed its deadline after 0 tokens" in caught.value.details()
    await wait_until(lambda: _status_is(config, "deadline-queued", b"failed"), 30, "the record ending failed")

    async def pages_free():
        load = await scheduler_load(config.scheduler_address)
        return load.num_running_requests == 0 and load.num_waiting_requests == 0 and load.num_kv_pages_used == 0

    await wait_until(pages_free, 30, "deadline-exceeded requests leaving the scheduler")


async def test_client_cancel_aborts_in_the_scheduler_frees_pages_and_records_cancelled(cluster):
    config, _ = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.GenerateStream(request("Cancel me", 480, "cancel-me"))
        received = 0
        async for message in call:
            received += len(message.token_ids)
            if received >= 3:
                load = await scheduler_load(config.scheduler_address)
                assert "cancel-me" in load.running_request_ids and load.num_kv_pages_used > 0
                call.cancel()
                break

    async def freed():
        load = await scheduler_load(config.scheduler_address)
        return load.num_running_requests == 0 and load.num_kv_pages_used == 0

    await wait_until(freed, 30, "the cancelled request's pages freed", interval_s=0.02)

    await wait_until(lambda: _status_is(config, "cancel-me", b"cancelled"), 30, "the record ending cancelled")
    with redis.Redis.from_url(config.effective_redis_url) as client:
        generated = sum(len(fields[b"t"].split()) for _, fields in client.xrange("tokenmill:tokens:cancel-me"))
    # tokens generated past the ones the client saw: the steps the cancel took to reach the scheduler
    print(f"cancel: client saw {received} tokens, the scheduler generated {generated} before the abort")
    assert generated < 480


async def _status_is(config, request_id: str, status: bytes) -> bool:
    with redis.Redis.from_url(config.effective_redis_url) as client:
        return client.hget(f"tokenmill:req:{request_id}", "status") == status


async def test_worker_killed_mid_generation_is_restarted_and_requests_finish_by_recompute(cluster):
    config, supervisor = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        undisturbed, _ = await collect(stub.GenerateStream(request("The worker dies", LONG)))
        old_pid = supervisor.pid("worker")
        call = stub.GenerateStream(request("The worker dies", LONG, "survives-worker-kill"))
        ids = []
        async for message in call:
            ids += message.token_ids
            if len(ids) >= 5 and supervisor.pid("worker") == old_pid:
                kill9(supervisor, "worker")
            if message.finish_reason:
                break
        assert supervisor.pid("worker") != old_pid, "the supervisor restarted the worker"
        assert ids == undisturbed, "recompute after the restart continues the greedy output exactly"
        assert message.finish_reason == common_pb2.FINISH_REASON_LENGTH
        status = await stub.GetRequestStatus(generation_pb2.GetRequestStatusRequest(request_id="survives-worker-kill"))
        assert status.num_preemptions >= 1, "the request was re-queued, not finished before the kill"
    assert await wait_until(lambda: generate_ok(config.gateway_address), 60, "serving after the worker restart")


async def test_scheduler_killed_refuses_new_calls_fast_and_the_stream_in_flight_goes_on_after_readmission(cluster):
    config, supervisor = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        streaming = asyncio.Event()

        async def in_flight():
            ids = []
            async for message in stub.GenerateStream(request("The scheduler dies", 480, "lost-with-scheduler"),
                                                     timeout=180):
                ids += message.token_ids
                if len(ids) >= 3:
                    streaming.set()
            return ids, message

        stream = asyncio.ensure_future(in_flight())
        await asyncio.wait_for(streaming.wait(), 60)
        kill9(supervisor, "scheduler")
        # while it restarts: every new call is answered at once, and the breaker opens
        answers = []
        for _ in range(6):
            started = time.monotonic()
            try:
                await stub.Generate(request("while down", 2), timeout=30)
                answers.append(("ok", time.monotonic() - started, ""))
            except grpc.aio.AioRpcError as error:
                answers.append((error.code(), time.monotonic() - started, error.details()))
        unavailable = [a for a in answers if a[0] == grpc.StatusCode.UNAVAILABLE]
        assert unavailable and answers[0][0] == grpc.StatusCode.UNAVAILABLE, answers
        assert all(seconds < 2.0 for _, seconds, _ in unavailable), answers
        assert any("circuit open" in details for _, _, details in unavailable), answers
        # the stream in flight never saw the kill: the gateway followed it from Redis once re-admitted
        ids, last = await stream
        assert len(ids) == 480 and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    # the supervisor restarts it; the gateway's half-open probe closes the breaker
    assert await wait_until(lambda: generate_ok(config.gateway_address), 90, "serving after the scheduler restart")

    async def record_finished():  # re-admitted by the restarted scheduler, not left running or failed
        with redis.Redis.from_url(config.effective_redis_url) as client:
            return client.hget("tokenmill:req:lost-with-scheduler", "status") == b"finished"

    await wait_until(record_finished, 90, "the lost request, re-admitted, finishing")


async def test_scheduler_killed_mid_generation_readmits_its_requests_their_streams_go_on_and_a_client_resumes_by_id(
        cluster):
    config, supervisor = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        undisturbed, _ = await collect(stub.GenerateStream(request("Readmit me", LONG)))
        alone = asyncio.ensure_future(collect(stub.GenerateStream(request("Beside it", LONG, "readmit-alone"))))
        old_pid, ids, at_kill = supervisor.pid("scheduler"), [], 0
        async for message in stub.GenerateStream(request("Readmit me", LONG, "readmit-me"), timeout=180):
            ids += message.token_ids
            if len(ids) >= 5 and supervisor.pid("scheduler") == old_pid:
                kill9(supervisor, "scheduler")
                at_kill = len(ids)
        assert 5 <= at_kill < LONG and supervisor.pid("scheduler") != old_pid
        assert ids == undisturbed, "recomputed from the streamed tokens: no token lost, repeated or different"
        assert message.finish_reason == common_pb2.FINISH_REASON_LENGTH
        alone_ids, _ = await alone
        assert len(alone_ids) == LONG
    assert await wait_until(lambda: generate_ok(config.gateway_address), 90, "serving after the scheduler restart")
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:  # and by id, from where it broke
        resumed = request("Readmit me", LONG, "readmit-me")
        resumed.resume_from_index = at_kill
        rest, last = await collect(generation_pb2_grpc.GenerationStub(channel).GenerateStream(resumed, timeout=120))
    assert ids[:at_kill] + rest == undisturbed and last.finish_reason == common_pb2.FINISH_REASON_LENGTH

    async def alone_finished():
        with redis.Redis.from_url(config.effective_redis_url) as client:
            return client.hget("tokenmill:req:readmit-alone", "status") == b"finished"

    await wait_until(alone_finished, 90, "the other request re-admitted and running to its end")
    with redis.Redis.from_url(config.effective_redis_url) as client:
        entries = [fields for _, fields in client.xrange("tokenmill:tokens:readmit-alone")]
        assert sum(len(fields[b"t"].split()) for fields in entries) == LONG
        assert [fields.get(b"f") for fields in entries].count(b"LENGTH") == 1
        assert int(client.hget("tokenmill:req:readmit-alone", "num_preemptions")) >= 1  # the re-admission
        assert not client.hexists(f"tokenmill:live:{config.scheduler_address}", "readmit-alone")
        for key in ("tokens", "req", "claim"):  # what is left of it is cleaned after its TTL
            assert 0 < client.ttl(f"tokenmill:{key}:readmit-alone") <= 3600, key


async def test_redis_down_generation_continues_readiness_reports_it_and_records_catch_up(cluster):
    config, supervisor = cluster
    supervisor.kill("redis")
    try:
        async def redis_health(wanted):
            async with grpc.aio.insecure_channel(config.scheduler_address) as channel:
                health = health_pb2_grpc.HealthStub(channel)
                redis_status = await health.Check(health_pb2.HealthCheckRequest(service=REDIS_HEALTH_SERVICE), timeout=5)
                ready = await health.Check(health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=5)
                live = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            serving = health_pb2.HealthCheckResponse.SERVING
            return redis_status.status == wanted and ready.status == serving and live.status == serving

        await wait_until(lambda: redis_health(health_pb2.HealthCheckResponse.NOT_SERVING), 30,
                         "the scheduler reporting Redis as NOT_SERVING (still ready and live)")
        async with grpc.aio.insecure_channel(config.gateway_address) as channel:
            reply = await generation_pb2_grpc.GenerationStub(channel).Generate(
                request("Redis is down", 8, "during-redis-outage"), timeout=60)
        assert len(reply.token_ids) == 8 and reply.finish_reason == common_pb2.FINISH_REASON_LENGTH
    finally:
        supervisor.restart("redis")
    await wait_until(lambda: redis_health(health_pb2.HealthCheckResponse.SERVING), 30, "Redis SERVING again")

    async def record_caught_up():
        with redis.Redis.from_url(config.effective_redis_url) as client:
            record = client.hgetall("tokenmill:req:during-redis-outage")
        return record.get(b"status") == b"finished" and record.get(b"num_output_tokens") == b"8"

    await wait_until(record_caught_up, 30, "the record written during the outage reaching Redis")


async def test_gateway_killed_mid_stream_the_client_resumes_by_request_id_without_loss_or_repeat(cluster):
    config, supervisor = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        undisturbed, _ = await collect(stub.GenerateStream(request("Resume me", 480)))
        old_pid, ids = supervisor.pid("gateway"), []
        with pytest.raises(grpc.aio.AioRpcError):
            async for message in stub.GenerateStream(request("Resume me", 480, "resume-me")):
                ids += message.token_ids
                if len(ids) >= 5 and supervisor.pid("gateway") == old_pid:
                    kill9(supervisor, "gateway")
        assert 5 <= len(ids) < 480
    assert await wait_until(lambda: generate_ok(config.gateway_address), 90, "the restarted gateway serving")
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        resumed = request("Resume me", 480, "resume-me")
        resumed.resume_from_index = len(ids)
        rest, last = await collect(stub.GenerateStream(resumed))
        assert ids + rest == undisturbed, "no token lost or repeated across the gateway restart"
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH and last.usage.completion_tokens == 480
        # the same id sent again attaches to the finished request: its whole stream, not a second run
        again, _ = await collect(stub.GenerateStream(request("Resume me", 480, "resume-me")))
        assert again == undisturbed
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            never = request("Resume me", 4, "never-submitted")
            never.resume_from_index = 2
            await collect(stub.GenerateStream(never))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    with redis.Redis.from_url(config.effective_redis_url) as client:
        entries = [fields for _, fields in client.xrange("tokenmill:tokens:resume-me")]
    assert sum(len(fields[b"t"].split()) for fields in entries) == 480, "the scheduler ran it once"
    assert [fields.get(b"f") for fields in entries].count(b"LENGTH") == 1


async def test_one_request_id_runs_one_request_even_through_two_gateways_at_once(cluster):
    config, _ = cluster
    port = free_port("127.0.0.1")
    second = ChildSpec("gateway-2", [sys.executable, "-m", "gateway.main", "--port", str(port), "--http-port", "0",
                                     "--scheduler", config.scheduler_address, "--model", config.model],
                       GENERATION_SERVICE, f"127.0.0.1:{port}", env={"TOKENMILL_REDIS_URL": config.effective_redis_url})
    with Supervisor([second], echo=False, startup_timeout_s=120):
        async with grpc.aio.insecure_channel(config.gateway_address) as one, \
                grpc.aio.insecure_channel(second.address) as two:
            stubs = [generation_pb2_grpc.GenerationStub(one), generation_pb2_grpc.GenerationStub(two)]
            # the same request under one id, 8 times at once over both replicas: it runs once, all get its tokens
            same = await asyncio.gather(*(collect(stubs[i % 2].GenerateStream(request("Only once", 40, "one-id")))
                                          for i in range(8)))
            assert all(ids == same[0][0] and len(ids) == 40 for ids, _ in same)
            # different prompts under one id at once: one runs, every other is refused naming the id
            results = await asyncio.gather(*(collect(stubs[i % 2].GenerateStream(request(f"prompt {i}", 8, "contested")))
                                             for i in range(6)), return_exceptions=True)
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) == 5, results
    assert all(e.code() == grpc.StatusCode.ALREADY_EXISTS and "request_id 'contested'" in e.details() for e in refused)
    with redis.Redis.from_url(config.effective_redis_url) as client:
        for request_id in ("one-id", "contested"):
            finishes = [f.get(b"f") for _, f in client.xrange(f"tokenmill:tokens:{request_id}")]
            assert len([f for f in finishes if f]) == 1, f"{request_id} ran {len([f for f in finishes if f])} times"


async def sigterm_until_not_serving(supervisor, child: str, address: str, service: str) -> asyncio.Task:
    """SIGTERM to child, then waits until its readiness (service at address) says NOT_SERVING; returns
    the task that ends with the child's exit code."""
    exit_code = asyncio.create_task(asyncio.to_thread(supervisor.children[child].kill, signal.SIGTERM, 120))

    async def not_ready():
        async with grpc.aio.insecure_channel(address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5)
        return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

    await wait_until(not_ready, 10, f"{child} readiness NOT_SERVING after SIGTERM", interval_s=0.01)
    return exit_code


async def test_sigterm_drains_the_gateway_refuses_new_requests_and_exits_zero(cluster):
    config, supervisor = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.GenerateStream(request("Drain me", 480, "in-flight-at-sigterm"))
        ids, exit_code = [], None
        async for message in call:
            ids += message.token_ids
            if exit_code is None and len(ids) >= 3:
                exit_code = await sigterm_until_not_serving(supervisor, "gateway", config.gateway_address,
                                                            GENERATION_SERVICE)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(request("too late", 2), timeout=10)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "draining" in refused.value.details()
        assert len(ids) == 480 and message.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert await exit_code == 0
    supervisor.restart("gateway")


async def test_sigterm_drains_the_scheduler_then_without_retry_a_killed_worker_fails_within_5s(cluster):
    config, supervisor = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        ids, exit_code = [], None
        redis_process = supervisor.children["redis"]
        try:
            async for message in stub.GenerateStream(request("Drain the scheduler", 480)):
                ids += message.token_ids
                if exit_code is None and len(ids) >= 3:
                    # Redis hung across the SIGTERM: the scheduler's shutdown awaits it (its load report's
                    # close, up to the 2 s socket timeout) after readiness turned NOT_SERVING, so a Submit
                    # admitted in that window (new work refused only after it) would run to the end here
                    redis_process.send_signal(signal.SIGSTOP)
                    exit_code = await sigterm_until_not_serving(supervisor, "scheduler", config.scheduler_address,
                                                                SCHEDULER_SERVICE)
                    with pytest.raises(grpc.aio.AioRpcError) as refused:
                        await stub.Generate(request("too late", 2), timeout=10)
                    redis_process.send_signal(signal.SIGCONT)
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:  # whatever failed, Redis runs on for the tests after this one
            redis_process.send_signal(signal.SIGCONT)
        assert len(ids) == 480 and message.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert await exit_code == 0
    # back with retry switched off
    spec = supervisor.children["scheduler"].spec
    supervisor.replace_spec("scheduler", dataclasses.replace(spec, argv=[*spec.argv, "--no-retry-on-worker-failure"]))
    supervisor.restart("scheduler")
    await wait_until(lambda: generate_ok(config.gateway_address), 60, "serving with the retry-off scheduler")
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).GenerateStream(request("No retry", 480))
        killed_at = None
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for message in call:
                if killed_at is None:
                    kill9(supervisor, "worker")
                    killed_at = time.monotonic()
        failed_after = time.monotonic() - killed_at
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "worker unavailable" in caught.value.details()
    print(f"UNAVAILABLE {failed_after:.3f}s after kill -9 of the worker (bound: 5 s)")
    assert failed_after < 5.0
    assert await wait_until(lambda: generate_ok(config.gateway_address), 90, "serving once the worker is back")
