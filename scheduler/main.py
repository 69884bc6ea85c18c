"""The scheduler process: `python -m scheduler.main --worker HOST:PORT ...`."""
from __future__ import annotations

import argparse
import logging

from protos.tokenmill.v1 import common_pb2, scheduler_pb2_grpc
from scheduler.config import KV_POLICIES, QUEUE_POLICIES, SchedulerConfig
from scheduler.loop import EngineLoop
from scheduler.scheduler import Scheduler
from scheduler.service import SchedulerServicer, drain
from scheduler.worker_client import WorkerClient
from tokenmill import rpc, telemetry
from tokenmill.telemetry.metrics import watch_scheduler
from tokenmill.process import run_process, wait_for_stop_signal

logger = logging.getLogger("tokenmill.scheduler")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scheduler.main", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50052)
    parser.add_argument("--worker", default="127.0.0.1:50053", help="worker address HOST:PORT")
    parser.add_argument("--redis-url", default="", help="request state store; empty: no request records")
    parser.add_argument("--state-ttl-s", type=int, default=3600, help="how long request records live in Redis")
    parser.add_argument("--kv-policy", choices=KV_POLICIES, default="paged")
    parser.add_argument("--queue-policy", choices=QUEUE_POLICIES, default="fcfs")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-waiting-requests", type=int, default=4096)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--worker-timeout-s", type=float, default=600.0, help="how long to wait for the worker")
    parser.add_argument("--drain-timeout-s", type=float, default=30.0)
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    await telemetry.start_process("scheduler", args.metrics_port, args.host)  # before any gRPC channel or server
    server = rpc.create_server()
    health = rpc.add_health_and_reflection(server, [rpc.SCHEDULER_SERVICE])
    address = f"{args.host}:{args.port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"scheduler: cannot listen on {address} (in use?); change --port")
    worker = WorkerClient(args.worker)
    state = None
    if args.redis_url:
        from kvstore.state_writer import RequestStateWriter

        state = RequestStateWriter(args.redis_url, ttl_s=args.state_ttl_s)
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
        queue_policy=args.queue_policy, enable_prefix_caching=not args.no_prefix_caching)
    loop = EngineLoop(Scheduler(config), worker, state, model_name=capacity.model_config.name,
                      max_waiting_requests=args.max_waiting_requests)
    model_info = common_pb2.GetModelInfoResponse(
        model_config=capacity.model_config, block_size=capacity.block_size, num_blocks=capacity.num_blocks,
        kv_cache_policy=common_pb2.KV_CACHE_POLICY_STATIC if args.kv_policy == "static"
        else common_pb2.KV_CACHE_POLICY_PAGED, device=capacity.device)
    servicer.attach(loop, model_info)
    watch_scheduler(loop.scheduler.stats)
    if state:
        state.start()
    loop.start()
    await health.set_ready(True)
    logger.info("scheduler ready: %d KV pages of %d tokens, policy %s", config.num_blocks, config.block_size,
                config.kv_policy)

    await wait_for_stop_signal()
    logger.info("scheduler draining (%d requests in flight)", len(loop.streams))
    await health.enter_graceful_shutdown()
    await drain(loop, args.drain_timeout_s)
    await server.stop(grace=1.0)
    await loop.stop()
    if state:
        await state.aclose()
    await worker.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_process(serve(args))


if __name__ == "__main__":
    main()
