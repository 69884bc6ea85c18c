"""The scheduler process: `python -m scheduler.main --worker HOST:PORT ...`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os

from grpc_health.v1.health_pb2 import HealthCheckResponse

from kvstore.redis_health import REDIS_HEALTH_SERVICE, watch_redis
from protos.tokenmill.v1 import common_pb2, scheduler_pb2_grpc
from scheduler.admission import Admission, AdmissionConfig
from scheduler.config import KV_POLICIES, QUEUE_POLICIES, SchedulerConfig
from scheduler.loop import EngineLoop
from scheduler.scheduler import Scheduler
from scheduler.orphans import ORPHAN_TIMEOUT_S, start_orphan_reaper
from scheduler.service import SchedulerServicer, drain
from scheduler.worker_client import WorkerClient
from scheduler.worker_recovery import WorkerRecovery
from plumbing import internal_secret, peer_roles, rpc, telemetry, tls
from plumbing.drain import DrainInterceptor
from plumbing.message_size import INTERNAL_MAX_MESSAGE_BYTES, add_message_size_argument, message_size_options
from plumbing.telemetry import metrics
from plumbing.telemetry.metrics import watch_redis_writers, watch_scheduler
from plumbing.process import run_process, wait_for_stop_signal

logger = logging.getLogger("tokenmill.scheduler")
SERVING, NOT_SERVING = HealthCheckResponse.SERVING, HealthCheckResponse.NOT_SERVING


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m scheduler.main", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50052)
    parser.add_argument("--worker", default="127.0.0.1:50053", help="worker address HOST:PORT")
    parser.add_argument("--redis-url", default=os.environ.get("TOKENMILL_REDIS_URL", ""),
                        help="request state store, redis://[USER:PASSWORD@]HOST:PORT/DB (default: "
                             "$TOKENMILL_REDIS_URL, which keeps a password out of the process list); "
                             "empty: no request records")
    parser.add_argument("--state-ttl-s", type=int, default=3600, help="how long request records live in Redis")
    parser.add_argument("--kv-policy", choices=KV_POLICIES, default="paged")
    parser.add_argument("--queue-policy", choices=QUEUE_POLICIES, default="fcfs")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--target-itl-ms", type=float, default=None,
                        help="inter-token latency target: each step's token budget and the running-set size follow "
                             "a learnt step-time model (the two flags above become upper bounds)")
    parser.add_argument("--target-ttft-ms", type=float, default=None,
                        help="time-to-first-token target: a request about to miss it gets the full budget")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-waiting-requests", type=int, default=4096,
                        help="requests queued beyond the running batch; more are refused with RESOURCE_EXHAUSTED")
    parser.add_argument("--max-waiting-tokens", type=int, default=0,
                        help="prompt tokens queued beyond the running batch; 0: no bound")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="plan and send step N+1 while the worker runs step N (docs/gpu.md)")
    parser.add_argument("--worker-timeout-s", type=float, default=600.0, help="how long to wait for the worker")
    parser.add_argument("--drain-timeout-s", "--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM: readiness off, new requests UNAVAILABLE, in-flight ones get this long")
    parser.add_argument("--no-retry-on-worker-failure", action="store_true",
                        help="requests on a worker that crashed fail (UNAVAILABLE) instead of being recomputed")
    parser.add_argument("--orphan-timeout-s", type=float, default=ORPHAN_TIMEOUT_S,
                        help="with Redis, a resumable request whose client went away (its gateway died, or it was "
                             "re-admitted after a restart) and that no gateway follows from Redis for this long is "
                             "aborted, rather than decoding to max_tokens for nobody; 0: never")
    parser.add_argument("--worker-reconnect-timeout-s", type=float, default=60.0,
                        help="how long requests wait for a crashed worker to come back before failing")
    add_message_size_argument(parser, INTERNAL_MAX_MESSAGE_BYTES)
    tls.add_server_arguments(parser)
    peer_roles.add_arguments(parser, ["gateway"])
    tls.add_client_arguments(parser, "worker")
    internal_secret.add_arguments(parser, "callers other than health checks must send it, and this scheduler sends "
                                          "it to its worker")
    parser.add_argument("--advertise-address", default="",
                        help="HOST:PORT gateways dial to reach this scheduler; names its load and prefix keys "
                             "in Redis (default: --host:--port)")
    telemetry.add_metrics_argument(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.tls = tls.server_tls_from_args(parser, args)
    args.allowed_roles = peer_roles.allowed_roles_from_args(parser, args)
    args.worker_tls = tls.client_tls_from_args(parser, args, "worker")
    args.internal_secret = internal_secret.secret_from_args(parser, args)
    return args


async def serve(args: argparse.Namespace) -> None:
    await telemetry.start_process("scheduler", args.metrics_port, args.host)  # before any gRPC channel or server
    if args.redis_url:
        from kvstore.credentials import check_redis_credentials

        await check_redis_credentials(args.redis_url, "scheduler")
    peer_roles.check_internal_exposure("scheduler", args.host, bool(args.tls and args.tls.client_ca),
                                       args.insecure_internal)
    drain_calls = DrainInterceptor(["/tokenmill.v1.Scheduler/Submit"])  # SIGTERM: no new Submit, Abort still works
    callers = peer_roles.interceptors(args.tls, args.allowed_roles, "scheduler")  # mTLS: gateways only
    secret_check = internal_secret.interceptors(args.internal_secret, "scheduler")  # tokenmill serve: its gateway only
    server = rpc.create_server(interceptors=[*secret_check, drain_calls, *callers],
                               options=message_size_options(args.max_message_bytes))
    health = rpc.add_health_and_reflection(server, [rpc.SCHEDULER_SERVICE], reflection_on=not args.no_reflection)
    address = f"{args.host}:{args.port}"
    if tls.listen(server, address, args.tls) == 0:
        raise SystemExit(f"scheduler: cannot listen on {address} (in use?); change --port")
    worker = WorkerClient(args.worker, tls=args.worker_tls, max_message_bytes=args.max_message_bytes,
                          internal_secret=args.internal_secret)
    state = tokens = live = readmittable = None
    scheduler_id = args.advertise_address or address  # the same after a restart: it names what to re-admit
    if args.redis_url:
        from kvstore.live_requests import LiveRequestWriter
        from kvstore.state_writer import RequestStateWriter
        from kvstore.token_streams import TokenStreamWriter
        from scheduler.readmission import ReadmittableTokens

        state = RequestStateWriter(args.redis_url, ttl_s=args.state_ttl_s)
        tokens = TokenStreamWriter(args.redis_url, ttl_s=args.state_ttl_s)  # for resumable requests
        live = LiveRequestWriter(args.redis_url, scheduler_id, ttl_s=args.state_ttl_s)
        readmittable = ReadmittableTokens(tokens, live)  # re-admitted after a crash (scheduler.readmission)
    # Listen (health, reflection) while the worker loads; the servicer answers UNAVAILABLE until the
    # worker has registered and the loop exists.
    servicer = SchedulerServicer()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(servicer, server)
    await server.start()
    logger.info("scheduler listening on %s; waiting for worker %s", address, args.worker)
    capacity = await worker.register(timeout_s=args.worker_timeout_s)
    model_len = capacity.model_config.max_context_length
    config = SchedulerConfig(
        num_blocks=capacity.num_blocks, block_size=capacity.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=min(args.max_model_len or model_len, model_len), kv_policy=args.kv_policy,
        queue_policy=args.queue_policy, enable_prefix_caching=not args.no_prefix_caching,
        num_host_blocks=capacity.num_host_blocks, bytes_per_block=capacity.kv_cache_bytes // capacity.num_blocks,
        target_itl_ms=args.target_itl_ms, target_ttft_ms=args.target_ttft_ms,
        sliding_window=capacity.model_config.sliding_window or None)
    admission = Admission(AdmissionConfig(args.max_waiting_requests, args.max_waiting_tokens),
                          vocab_size=capacity.model_config.vocab_size, max_model_len=config.max_model_len)
    recovery = WorkerRecovery(worker.reconnect, retry=not args.no_retry_on_worker_failure,
                              reconnect_timeout_s=args.worker_reconnect_timeout_s)
    loop = EngineLoop(Scheduler(config), worker, state, model_name=capacity.model_config.name,
                      admission=admission, worker_recovery=recovery, tokens=readmittable,
                      async_scheduling=args.async_scheduling, live=readmittable)
    model_info = common_pb2.GetModelInfoResponse(
        model_config=capacity.model_config, block_size=capacity.block_size, num_blocks=capacity.num_blocks,
        kv_cache_policy=common_pb2.KV_CACHE_POLICY_STATIC if args.kv_policy == "static"
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
            args.redis_url, lambda: state.healthy and tokens.healthy,
            lambda ok: health.set(REDIS_HEALTH_SERVICE, SERVING if ok else NOT_SERVING)))
    loop.start()
    if live:
        from kvstore.live_requests import LiveRequestReader
        from scheduler.readmission import readmit

        reader = LiveRequestReader(args.redis_url, scheduler_id)
        await readmit(loop, reader)  # before ready: what this scheduler ran when it died runs on
        await reader.aclose()
    reporter = orphans = None
    if args.redis_url:
        from scheduler.load_report import LoadReporter

        reporter = LoadReporter(args.redis_url, args.advertise_address or address, loop)
        reporter.start()
        orphans = start_orphan_reaper(loop, args.redis_url, args.orphan_timeout_s)  # None when off
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
    await drain_calls.drain(args.drain_timeout_s)
    # resumable requests whose gateway died have no call left to wait for: the rest of the timeout
    await drain(loop, max(args.drain_timeout_s - (asyncio.get_running_loop().time() - draining_since), 0.0),
                args.drain_timeout_s)
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
    args = parse_args(argv)
    run_process(serve(args))


if __name__ == "__main__":
    main()
