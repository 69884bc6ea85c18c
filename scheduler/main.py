"""The scheduler process: `python -m scheduler.main --worker HOST:PORT ...`."""
from __future__ import annotations

import argparse
import asyncio
import logging

import grpc

from plumbing import internal_secret, peer_roles, rpc, telemetry, tls
from plumbing.drain import DrainInterceptor
from plumbing.message_size import message_size_options
from plumbing.process import run_process, settle_heap, wait_for_stop_signal
from plumbing.rpc import ReadinessHealthServicer
from plumbing.telemetry import metrics
from plumbing.telemetry.metrics import watch_scheduler
from protos.tokenmill.v1 import common_pb2, scheduler_pb2_grpc
from protos.tokenmill.v1.worker_pb2 import GetCapacityResponse as WorkerCapacity
from scheduler.admission import Admission, AdmissionConfig
from scheduler.options import SchedulerOptions, add_shared_arguments, shared_values
from scheduler.process.loop import EngineLoop
from scheduler.process.redis_side import NoRedis, RedisSide
from scheduler.process.service import SchedulerServicer
from scheduler.process.submissions import drain
from scheduler.process.worker_client import WorkerClient
from scheduler.process.worker_recovery import WorkerRecovery
from scheduler.scheduler import Scheduler
from scheduler.speculation import check_draft_model

logger = logging.getLogger("tokenmill.scheduler")


def build_parser() -> argparse.ArgumentParser:
    return SchedulerOptions.service_parser("scheduler.main", __doc__, add_shared_arguments)


def parse_args(argv: list[str] | None = None) -> SchedulerOptions:
    parser = build_parser()
    args = parser.parse_args(argv)
    return SchedulerOptions.from_args(args, **shared_values(parser, args))


async def serve(options: SchedulerOptions) -> None:
    await telemetry.start_process("scheduler", options.metrics_port, options.host)  # before any gRPC channel or server
    address = f"{options.host}:{options.port}"
    scheduler_id = options.advertise_address or address  # the same after a restart: it names what to re-admit
    redis = await RedisSide.open(options, scheduler_id)
    server, health, drain_calls = _server(options, address)
    worker = WorkerClient(options.worker, tls=options.worker_tls, max_message_bytes=options.max_message_bytes,
                          internal_secret=options.internal_secret)
    # Listen (health, reflection) while the worker loads; the servicer answers UNAVAILABLE until the
    # worker has registered and the loop exists.
    servicer = SchedulerServicer()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    await server.start()
    logger.info("scheduler listening on %s; waiting for worker %s", address, options.worker)
    capacity = await worker.register(timeout_s=options.worker_timeout_s)
    try:
        check_draft_model(options.speculative, capacity.draft_model)
    except ValueError as error:
        raise SystemExit(f"scheduler: {error} (the worker at {options.worker} has "
                         f"{capacity.draft_model or 'no draft model'})") from None
    loop = _engine_loop(options, capacity, worker, redis)
    servicer.attach(loop, _model_info(options, capacity))
    metrics.set_model_name(capacity.model_config.name)
    config = loop.scheduler.config
    # waiting = queued + just arrived (still in the inbox while a step runs), exact at scrape time
    watch_scheduler(loop.stats, cache_config={
        "block_size": config.block_size, "num_gpu_blocks": config.num_blocks, "cache_dtype": "auto",
        "enable_prefix_caching": config.prefix_caching, "kv_policy": config.kv_policy})
    loop.start()
    await redis.start(loop, health)  # before ready: what this scheduler ran when it died runs on
    settle_heap()  # before ready: the first steps must not wait for its collection
    await health.set_ready(True)
    logger.info("scheduler ready: %d KV pages of %d tokens, policy %s", config.num_blocks, config.block_size,
                config.kv_policy)

    await wait_for_stop_signal()
    await _shut_down(options, server, health, drain_calls, loop, redis)
    await worker.close()


def _server(options: SchedulerOptions, address: str) -> tuple[grpc.aio.Server, ReadinessHealthServicer,
                                                                DrainInterceptor]:
    """The gRPC server, listening, with its callers' checks, health and reflection; no servicer yet."""
    peer_roles.check_internal_exposure("scheduler", options.host, bool(options.tls and options.tls.client_ca),
                                       options.insecure_internal)
    drain_calls = DrainInterceptor(["/tokenmill.v1.Scheduler/Submit"])  # SIGTERM: no new Submit, Abort still works
    callers = peer_roles.interceptors(options.tls, options.allowed_roles, "scheduler")  # mTLS: gateways only
    secret_check = internal_secret.interceptors(options.internal_secret, "scheduler")  # tokenmill serve: its gateway only
    server = rpc.create_server(interceptors=[*secret_check, drain_calls, *callers],
                               options=message_size_options(options.max_message_bytes))
    health = rpc.add_health_and_reflection(server, [rpc.SCHEDULER_SERVICE], reflection_on=options.reflection)
    if tls.listen(server, address, options.tls) == 0:
        raise SystemExit(f"scheduler: cannot listen on {address} (in use?); change --port")
    return server, health, drain_calls


def _engine_loop(options: SchedulerOptions, capacity: WorkerCapacity, worker: WorkerClient,
                 redis: RedisSide | NoRedis) -> EngineLoop:
    """The step loop over a Scheduler sized by what the worker registered, not started yet."""
    model = capacity.model_config
    config = options.scheduler_config(
        num_blocks=capacity.num_blocks, block_size=capacity.block_size, model_max_len=model.max_context_length,
        num_host_blocks=capacity.num_host_blocks, bytes_per_block=capacity.kv_cache_bytes // capacity.num_blocks,
        sliding_window=model.sliding_window or None)
    admission = Admission(AdmissionConfig(options.max_waiting_requests, options.max_waiting_tokens),
                          vocab_size=model.vocab_size, max_model_len=config.max_model_len)
    recovery = WorkerRecovery(worker.reconnect, retry=options.retry_on_worker_failure,
                              reconnect_timeout_s=options.worker_reconnect_timeout_s)
    loop = EngineLoop(Scheduler(config), worker, redis.state, model_name=model.name, admission=admission,
                      worker_recovery=recovery, tokens=redis.tokens, async_scheduling=options.async_scheduling,
                      live=redis.tokens)

    def worker_lost() -> None:
        recovery.notice_loss()
        loop.wake()

    worker.watch_connection(worker_lost)
    return loop


def _model_info(options: SchedulerOptions, capacity: WorkerCapacity) -> common_pb2.GetModelInfoResponse:
    return common_pb2.GetModelInfoResponse(
        model_config=capacity.model_config, block_size=capacity.block_size, num_blocks=capacity.num_blocks,
        kv_cache_policy=common_pb2.KV_CACHE_POLICY_STATIC if options.kv_policy == "static"
        else common_pb2.KV_CACHE_POLICY_PAGED, device=capacity.device)


async def _shut_down(options: SchedulerOptions, server: grpc.aio.Server, health: ReadinessHealthServicer,
                     drain_calls: DrainInterceptor, loop: EngineLoop, redis: RedisSide | NoRedis) -> None:
    """SIGTERM: readiness off and no new Submit, then the calls in flight get the drain timeout."""
    logger.info("scheduler draining (%d requests in flight)", len(loop.streams))
    drain_calls.refuse_new()  # first: the load report's close below awaits Redis, with readiness already off
    await health.enter_graceful_shutdown()
    await redis.withdraw()  # gateways stop routing here while it drains
    draining_since = asyncio.get_running_loop().time()
    await drain_calls.drain(options.drain_timeout_s)
    # resumable requests whose gateway died have no call left to wait for: the rest of the timeout
    elapsed_s = asyncio.get_running_loop().time() - draining_since
    await drain(loop, max(options.drain_timeout_s - elapsed_s, 0.0), options.drain_timeout_s)
    await server.stop(grace=1.0)
    await loop.stop()
    await redis.aclose()


def main(argv: list[str] | None = None) -> None:
    run_process(serve(parse_args(argv)))


if __name__ == "__main__":
    main()
