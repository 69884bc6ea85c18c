"""The scheduler process: `python -m scheduler.main --worker HOST:PORT ...`."""
from __future__ import annotations

import argparse
import asyncio
import logging

from grpc_health.v1.health_pb2 import HealthCheckResponse

from kvstore.redis_health import REDIS_HEALTH_SERVICE, watch_redis
from protos.tokenmill.v1 import common_pb2, scheduler_pb2_grpc
from scheduler.admission import Admission, AdmissionConfig
from scheduler.config import SchedulerConfig
from scheduler.options import SchedulerOptions, add_shared_arguments, shared_values
from scheduler.process.loop import EngineLoop
from scheduler.scheduler import Scheduler
from scheduler.process.orphans import start_orphan_reaper
from scheduler.process.service import SchedulerServicer
from scheduler.process.submissions import drain
from scheduler.process.worker_client import WorkerClient
from scheduler.process.worker_recovery import WorkerRecovery
from plumbing import internal_secret, peer_roles, rpc, telemetry, tls
from plumbing.drain import DrainInterceptor
from plumbing.message_size import message_size_options
from plumbing.telemetry import metrics
from plumbing.telemetry.metrics import watch_redis_writers, watch_scheduler
from plumbing.process import run_process, wait_for_stop_signal

logger = logging.getLogger("tokenmill.scheduler")
SERVING, NOT_SERVING = HealthCheckResponse.SERVING, HealthCheckResponse.NOT_SERVING


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scheduler.main", description=__doc__)
    SchedulerOptions.add_arguments(parser)
    add_shared_arguments(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> SchedulerOptions:
    parser = build_parser()
    args = parser.parse_args(argv)
    return SchedulerOptions.from_args(args, **shared_values(parser, args))


async def serve(options: SchedulerOptions) -> None:
    await telemetry.start_process("scheduler", options.metrics_port, options.host)  # before any gRPC channel or server
    if options.redis_url:
        from kvstore.credentials import check_redis_credentials

        await check_redis_credentials(options.redis_url, "scheduler")
    peer_roles.check_internal_exposure("scheduler", options.host, bool(options.tls and options.tls.client_ca),
                                       options.insecure_internal)
    drain_calls = DrainInterceptor(["/tokenmill.v1.Scheduler/Submit"])  # SIGTERM: no new Submit, Abort still works
    callers = peer_roles.interceptors(options.tls, options.allowed_roles, "scheduler")  # mTLS: gateways only
    secret_check = internal_secret.interceptors(options.internal_secret, "scheduler")  # tokenmill serve: its gateway only
    server = rpc.create_server(interceptors=[*secret_check, drain_calls, *callers],
                               options=message_size_options(options.max_message_bytes))
    health = rpc.add_health_and_reflection(server, [rpc.SCHEDULER_SERVICE], reflection_on=options.reflection)
    address = f"{options.host}:{options.port}"
    if tls.listen(server, address, options.tls) == 0:
        raise SystemExit(f"scheduler: cannot listen on {address} (in use?); change --port")
    worker = WorkerClient(options.worker, tls=options.worker_tls, max_message_bytes=options.max_message_bytes,
                          internal_secret=options.internal_secret)
    state = tokens = live = readmittable = None
    scheduler_id = options.advertise_address or address  # the same after a restart: it names what to re-admit
    if options.redis_url:
        from kvstore.live_requests import LiveRequestWriter
        from kvstore.state_writer import RequestStateWriter
        from kvstore.token_streams import TokenStreamWriter
        from scheduler.process.readmission import ReadmittableTokens

        state = RequestStateWriter(options.redis_url, ttl_s=options.state_ttl_s)
        tokens = TokenStreamWriter(options.redis_url, ttl_s=options.state_ttl_s)  # for resumable requests
        live = LiveRequestWriter(options.redis_url, scheduler_id, ttl_s=options.state_ttl_s)
        readmittable = ReadmittableTokens(tokens, live)  # re-admitted after a crash (scheduler.process.readmission)
    # Listen (health, reflection) while the worker loads; the servicer answers UNAVAILABLE until the
    # worker has registered and the loop exists.
    servicer = SchedulerServicer()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    await server.start()
    logger.info("scheduler listening on %s; waiting for worker %s", address, options.worker)
    capacity = await worker.register(timeout_s=options.worker_timeout_s)
    model_len = capacity.model_config.max_context_length
    config = SchedulerConfig(
        num_blocks=capacity.num_blocks, block_size=capacity.block_size, max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_model_len=min(options.max_model_len or model_len, model_len), kv_policy=options.kv_policy,
        queue_policy=options.queue_policy, enable_prefix_caching=options.enable_prefix_caching,
        num_host_blocks=capacity.num_host_blocks, bytes_per_block=capacity.kv_cache_bytes // capacity.num_blocks,
        target_itl_ms=options.target_itl_ms, target_ttft_ms=options.target_ttft_ms,
        sliding_window=capacity.model_config.sliding_window or None)
    admission = Admission(AdmissionConfig(options.max_waiting_requests, options.max_waiting_tokens),
                          vocab_size=capacity.model_config.vocab_size, max_model_len=config.max_model_len)
    recovery = WorkerRecovery(worker.reconnect, retry=options.retry_on_worker_failure,
                              reconnect_timeout_s=options.worker_reconnect_timeout_s)
    loop = EngineLoop(Scheduler(config), worker, state, model_name=capacity.model_config.name,
                      admission=admission, worker_recovery=recovery, tokens=readmittable,
                      async_scheduling=options.async_scheduling, live=readmittable)
    model_info = common_pb2.GetModelInfoResponse(
        model_config=capacity.model_config, block_size=capacity.block_size, num_blocks=capacity.num_blocks,
        kv_cache_policy=common_pb2.KV_CACHE_POLICY_STATIC if options.kv_policy == "static"
        else common_pb2.KV_CACHE_POLICY_PAGED, device=capacity.device)

    def worker_lost() -> None:
        recovery.notice_loss()
        loop.wake()

    worker.watch_connection(worker_lost)
    servicer.attach(loop, model_info)
    metrics.set_model_name(capacity.model_config.name)
    # waiting = queued + just arrived (still in the inbox while a step runs), exact at scrape time
    watch_scheduler(loop.stats, cache_config={
        "block_size": config.block_size, "num_gpu_blocks": config.num_blocks, "cache_dtype": "auto",
        "enable_prefix_caching": config.prefix_caching, "kv_policy": config.kv_policy})
    redis_watch = None
    if state:
        state.start()
        tokens.start()
        live.start()
        # what a Redis outage longer than the writers' buffers cost: counted, never silent
        watch_redis_writers(lambda: {"record": state.stats.dropped, "token_stream": tokens.dropped})
        redis_watch = asyncio.get_running_loop().create_task(watch_redis(
            options.redis_url, lambda: state.healthy and tokens.healthy,
            lambda ok: health.set(REDIS_HEALTH_SERVICE, SERVING if ok else NOT_SERVING)))
    loop.start()
    if live:
        from kvstore.live_requests import LiveRequestReader
        from scheduler.process.readmission import readmit

        reader = LiveRequestReader(options.redis_url, scheduler_id)
        await readmit(loop, reader)  # before ready: what this scheduler ran when it died runs on
        await reader.aclose()
    reporter = orphans = None
    if options.redis_url:
        from scheduler.process.load_report import LoadReporter

        reporter = LoadReporter(options.redis_url, options.advertise_address or address, loop)
        reporter.start()
        orphans = start_orphan_reaper(loop, options.redis_url, options.orphan_timeout_s)  # None when off
    await health.set_ready(True)
    logger.info("scheduler ready: %d KV pages of %d tokens, policy %s", config.num_blocks, config.block_size,
                config.kv_policy)

    await wait_for_stop_signal()
    logger.info("scheduler draining (%d requests in flight)", len(loop.streams))
    drain_calls.refuse_new()  # first: the reporter's close below awaits Redis, with readiness already off
    await health.enter_graceful_shutdown()
    if reporter:
        await reporter.aclose()  # gateways stop routing here while it drains
    draining_since = asyncio.get_running_loop().time()
    await drain_calls.drain(options.drain_timeout_s)
    # resumable requests whose gateway died have no call left to wait for: the rest of the timeout
    await drain(loop, max(options.drain_timeout_s - (asyncio.get_running_loop().time() - draining_since), 0.0),
                options.drain_timeout_s)
    await server.stop(grace=1.0)
    await loop.stop()
    if orphans is not None:
        await orphans.aclose()
    if redis_watch is not None:
        redis_watch.cancel()
    if state:
        await state.aclose()
        await tokens.aclose()
        await live.aclose()
    await worker.close()


def main(argv: list[str] | None = None) -> None:
    run_process(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
