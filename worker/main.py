"""The worker process: `python -m worker.main --model PATH ...`. Ready only after a warm-up pass."""
from __future__ import annotations

import argparse
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc
import torch
from grpc_health.v1 import health as health_servicer
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tokenmill.v1 import worker_pb2, worker_pb2_grpc
from plumbing import internal_secret, peer_roles, rpc, telemetry, tls
from plumbing.telemetry import metrics
from plumbing.message_size import INTERNAL_MAX_MESSAGE_BYTES, add_message_size_argument, message_size_options
from plumbing.process import run_process, settle_heap, wait_for_stop_signal
from worker.build import build_follower, build_sized_runner, model_name, resolve_device
from worker.host_heap import THREAD_CACHE_OFF, give_back_freed_memory, keep_freed_memory, thread_cache_off
from worker.linears.group_quant import weight_formats
from worker.model_runner import ModelRunner
from worker.options import WorkerOptions
from worker.parallel.ranks import join_parallel, rank_threads, start_local_ranks, started_here
from worker.parallel.step_mirror import follow
from worker.service import WorkerServicer, model_config_to_proto

logger = logging.getLogger("tokenmill.worker")


def build_parser() -> argparse.ArgumentParser:
    return WorkerOptions.service_parser(
        "worker.main", __doc__, partial(add_message_size_argument, default=INTERNAL_MAX_MESSAGE_BYTES),
        tls.add_server_arguments, partial(peer_roles.add_arguments, default_roles=["scheduler"]),
        partial(internal_secret.add_arguments, use="callers other than health checks must send it"),
        telemetry.add_metrics_argument)


def parse_args(argv: list[str] | None = None) -> WorkerOptions:
    parser = build_parser()
    args = parser.parse_args(argv)
    return WorkerOptions.from_args(
        args, tls=tls.server_tls_from_args(parser, args), allowed_roles=peer_roles.allowed_roles_from_args(parser, args),
        internal_secret=internal_secret.secret_from_args(parser, args), max_message_bytes=args.max_message_bytes,
        metrics_port=args.metrics_port, insecure_internal=args.insecure_internal, no_reflection=args.no_reflection)


def build_worker(options: WorkerOptions) -> tuple[ModelRunner, worker_pb2.GetCapacityResponse]:
    parallel = join_parallel(options, resolve_device(options.device))  # None: one rank
    runner, sizing = build_sized_runner(options, parallel=parallel)
    logger.info("KV cache: %d pages of %d tokens in %s (%.1f MiB), from %s; swap tier: %d host pages",
                sizing.num_blocks, runner.block_size, str(runner.kv_cache.storage.dtype).removeprefix("torch."),
                sizing.kv_cache_bytes / 2**20, sizing.reason, runner.swap_space.num_host_blocks)
    started = time.perf_counter()
    runner.warm_up()  # readiness waits for this: the first real request must not pay for it
    logger.info("warm-up forward pass done in %.0f ms", (time.perf_counter() - started) * 1e3)
    if options.keep_freed_memory:
        give_back_freed_memory()  # the loader's temporaries; what steps free from now on stays (worker.host_heap)
    capacity = worker_pb2.GetCapacityResponse(
        num_blocks=runner.num_blocks, block_size=runner.block_size,
        model_config=model_config_to_proto(runner.model_config, model_name(options.model),
                                           str(runner.dtype).removeprefix("torch."), weight_formats(runner.model)),
        device=str(runner.device),
        kv_cache_bytes=sizing.kv_cache_bytes, kv_cache_sizing=sizing.reason,
        num_host_blocks=runner.swap_space.num_host_blocks,
        draft_model=model_name(options.draft_model) if options.draft_model else "", columnar_steps=True)
    return runner, capacity


async def serve(options: WorkerOptions) -> None:
    await telemetry.start_process("worker", options.metrics_port, options.host)  # before any gRPC server
    metrics.set_model_name(model_name(options.model))  # the model_name label of the step metrics
    peer_roles.check_internal_exposure("worker", options.host, bool(options.tls and options.tls.client_ca),
                                       options.insecure_internal)
    callers = peer_roles.interceptors(options.tls, options.allowed_roles, "worker")  # mTLS: schedulers only
    secret_check = internal_secret.interceptors(options.internal_secret, "worker")  # tokenmill serve: its scheduler only
    server = rpc.create_server(interceptors=[*secret_check, *callers],
                               options=message_size_options(options.max_message_bytes))
    health = rpc.add_health_and_reflection(server, [rpc.WORKER_SERVICE], reflection_on=not options.no_reflection)
    servicer = WorkerServicer()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    address = f"{options.host}:{options.port}"
    if tls.listen(server, address, options.tls) == 0:
        raise SystemExit(f"worker: cannot listen on {address} (in use?); change --port")
    await server.start()
    logger.info("worker listening on %s; loading the model", address)
    if options.keep_freed_memory and not thread_cache_off():
        logger.info("GLIBC_TUNABLES lacks %s: a step's large tensors are not always reused (worker.host_heap)",
                    THREAD_CACHE_OFF)
    runner, capacity = await servicer.run_compute(build_worker, options)
    servicer.attach(runner, capacity)
    settle_heap()  # before ready: the first step must not wait for its collection
    await health.set_ready(True)
    logger.info("worker ready: %s on %s, %d KV pages of %d tokens", capacity.model_config.name, capacity.device,
                capacity.num_blocks, capacity.block_size)
    await wait_for_stop_signal()
    await health.enter_graceful_shutdown()
    await server.stop(grace=2.0)
    if runner.parallel is not None:  # on the compute thread: after the step in flight, never beside it
        await servicer.run_compute(runner.parallel.channel.send, "stop")


def follow_rank_zero(options: WorkerOptions) -> None:
    """A rank > 0 of a tensor-parallel group: it runs what rank 0 sends (worker.parallel.step_mirror) and serves
    only gRPC health on --port for its pod's probes (tokenmill.v1.Worker SERVING once its share is loaded), and
    only where rank 0 did not start it (a pod of its own; a local child shares rank 0's host and port)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {options.rank} %(name)s: %(message)s")
    server, health = (None, None) if started_here(options) else _follower_health(options)
    parallel = join_parallel(options, resolve_device(options.device))
    build = build_follower(options, parallel)
    if health is not None:
        health.set(rpc.WORKER_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    follow(parallel.channel, build)
    if server is not None:
        server.stop(grace=None)


def _follower_health(options: WorkerOptions) -> tuple[grpc.Server, health_servicer.HealthServicer]:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health_servicer.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    servicer.set(rpc.WORKER_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)  # until its share is loaded
    server.add_insecure_port(f"{options.host}:{options.port}")  # health only: nothing to protect
    server.start()
    return server, servicer


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    if options.keep_freed_memory:
        keep_freed_memory()  # before the compute thread exists: it must share the main arena (worker.host_heap)
    if options.group_size > 1 and options.rendezvous is None:
        options = start_local_ranks(options)  # rank 0 on one machine: ranks 1..N-1 as its children
    torch.set_num_threads(rank_threads(options))
    if options.kernel_backend == "triton" and resolve_device(options.device).type != "cuda":
        # Triton kernels on a machine without CUDA run in its interpreter (slow; for checking only).
        # Triton reads this when a kernel module is imported, which happens after this point.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if options.rank > 0:
        follow_rank_zero(options)
    else:
        run_process(serve(options))


if __name__ == "__main__":
    main()
