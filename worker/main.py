"""The worker process: `python -m worker.main --model PATH ...`. Ready only after a warm-up pass."""
from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch

from protos.tokenmill.v1 import worker_pb2, worker_pb2_grpc
from plumbing import internal_secret, peer_roles, rpc, telemetry, tls
from plumbing.telemetry import metrics
from plumbing.message_size import INTERNAL_MAX_MESSAGE_BYTES, add_message_size_argument, message_size_options
from plumbing.process import run_process, wait_for_stop_signal
from worker.backends import add_execution_flags, execution_options_from_args
from worker.build import DTYPE_CHOICES, build_sized_runner, model_name, resolve_device
from worker.group_quant import weight_formats
from worker.model_runner import ModelRunner
from worker.service import WorkerServicer, model_config_to_proto

logger = logging.getLogger("tokenmill.worker")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker.main", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50053)
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="auto: bfloat16 on CUDA and on CPUs with avx512_bf16/AMX, else float32 (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV page (a power of two)")
    parser.add_argument("--kv-cache-mb", type=int, default=None,
                        help="memory budget for the KV cache; overrides --kv-cache-memory-fraction")
    parser.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                        help="share of the memory free after the weights and the profile pass's activation peak "
                             "that the KV cache takes (default: 0.9 on CUDA, 0.1 of available RAM on CPU)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512,
                        help="the largest step the scheduler plans: the profile pass runs one that size")
    parser.add_argument("--swap-space-gb", type=float, default=0.0,
                        help="host memory for swapped-out KV pages (pinned on CUDA); 0: preemption only recomputes")
    parser.add_argument("--num-blocks", type=int, default=None, help="KV pages; overrides --kv-cache-mb")
    parser.add_argument("--kv-sizing-record", type=Path, default=None,
                        help="JSON file where the first start records the KV cache size it chose from memory; a "
                             "restart with the same settings reuses it, so the scheduler meets the page count it "
                             "was built for. Put it where it outlives the process, not the deployment (tokenmill "
                             "serve: the worker's temp dir; Kubernetes: an emptyDir). Default: none, each start "
                             "sizes anew")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: all cores)")
    add_execution_flags(parser)
    add_message_size_argument(parser, INTERNAL_MAX_MESSAGE_BYTES)
    tls.add_server_arguments(parser)
    peer_roles.add_arguments(parser, ["scheduler"])
    internal_secret.add_arguments(parser, "callers other than health checks must send it")
    telemetry.add_metrics_argument(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.tls = tls.server_tls_from_args(parser, args)
    args.allowed_roles = peer_roles.allowed_roles_from_args(parser, args)
    args.internal_secret = internal_secret.secret_from_args(parser, args)
    if args.block_size <= 0 or args.block_size & (args.block_size - 1):
        parser.error(f"--block-size={args.block_size} must be a positive power of two")
    if args.kv_cache_memory_fraction is not None and not 0.0 < args.kv_cache_memory_fraction <= 1.0:
        parser.error(f"--kv-cache-memory-fraction={args.kv_cache_memory_fraction} must be in (0, 1]")
    if args.swap_space_gb < 0:
        parser.error(f"--swap-space-gb={args.swap_space_gb} must be >= 0")
    try:
        args.execution = execution_options_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def build_worker(args: argparse.Namespace) -> tuple[ModelRunner, worker_pb2.GetCapacityResponse]:
    runner, sizing = build_sized_runner(
        args.model, args.dtype, args.block_size, args.kv_cache_mb and args.kv_cache_mb * 2**20, args.num_blocks,
        device=args.device, options=args.execution, memory_fraction=args.kv_cache_memory_fraction,
        profile_tokens=args.max_num_batched_tokens, swap_space_bytes=int(args.swap_space_gb * 2**30),
        sizing_record=args.kv_sizing_record)
    logger.info("KV cache: %d pages of %d tokens (%.1f MiB), from %s; swap tier: %d host pages",
                sizing.num_blocks, runner.block_size, sizing.kv_cache_bytes / 2**20, sizing.reason,
                runner.swap_space.num_host_blocks)
    started = time.perf_counter()
    runner.warm_up()  # readiness waits for this: the first real request must not pay for it
    logger.info("warm-up forward pass done in %.0f ms", (time.perf_counter() - started) * 1e3)
    capacity = worker_pb2.GetCapacityResponse(
        num_blocks=runner.num_blocks, block_size=runner.block_size,
        model_config=model_config_to_proto(runner.model_config, model_name(args.model), str(runner.dtype).removeprefix("torch."),
                                           weight_formats(runner.model)),
        device=str(runner.device),
        kv_cache_bytes=sizing.kv_cache_bytes, kv_cache_sizing=sizing.reason,
        num_host_blocks=runner.swap_space.num_host_blocks)
    return runner, capacity


async def serve(args: argparse.Namespace) -> None:
    await telemetry.start_process("worker", args.metrics_port, args.host)  # before any gRPC server
    metrics.set_model_name(model_name(args.model))  # the model_name label of the step metrics
    peer_roles.check_internal_exposure("worker", args.host, bool(args.tls and args.tls.client_ca),
                                       args.insecure_internal)
    callers = peer_roles.interceptors(args.tls, args.allowed_roles, "worker")  # mTLS: schedulers only
    secret_check = internal_secret.interceptors(args.internal_secret, "worker")  # tokenmill serve: its scheduler only
    server = rpc.create_server(interceptors=[*secret_check, *callers],
                               options=message_size_options(args.max_message_bytes))
    health = rpc.add_health_and_reflection(server, [rpc.WORKER_SERVICE], reflection_on=not args.no_reflection)
    servicer = WorkerServicer()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    address = f"{args.host}:{args.port}"
    if tls.listen(server, address, args.tls) == 0:
        raise SystemExit(f"worker: cannot listen on {address} (in use?); change --port")
    await server.start()
    logger.info("worker listening on %s; loading the model", address)
    runner, capacity = await servicer.run_compute(build_worker, args)
    servicer.attach(runner, capacity)
    await health.set_ready(True)
    logger.info("worker ready: %s on %s, %d KV pages of %d tokens", capacity.model_config.name, capacity.device,
                capacity.num_blocks, capacity.block_size)
    await wait_for_stop_signal()
    await health.enter_graceful_shutdown()
    await server.stop(grace=2.0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    if args.execution.kernel_backend == "triton" and resolve_device(args.device).type != "cuda":
        # Triton kernels on a machine without CUDA run in its interpreter (slow; for checking only).
        # Triton reads this when a kernel module is imported, which happens after this point.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    run_process(serve(args))


if __name__ == "__main__":
    main()
