"""The gateway process: `python -m gateway.main --scheduler HOST:PORT --model PATH ...`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

import grpc

from gateway.access.control import AccessControl, AccessInterceptor, build_access
from gateway.apis.generation import GenerationServicer
from gateway.apis.openai import http_connections
from gateway.apis.served_model import ServedModel
from gateway.generation.generations import Generations
from gateway.generation.redis_readers import RedisReaders
from gateway.options import DEFAULT_SCHEDULER, GatewayOptions, add_process_arguments
from gateway.prepare.validation import Limits
from gateway.processes import GatewayGroup, child_options, process_count, watch_parent
from gateway.telemetry import set_model_name, set_server_address
from gateway.text.tokenizer import default_model_path, load_tokenizer
from gateway.upstream.scheduler_client import SchedulerClient
from gateway.upstream.target import SchedulerTarget
from plumbing import internal_secret, rpc, telemetry, tls
from plumbing.drain import DrainInterceptor
from plumbing.grammar_sandbox import GrammarSandbox
from plumbing.keepalive import server_options
from plumbing.message_size import message_size_options
from plumbing.process import run_process, settle_heap, wait_for_stop_signal
from plumbing.rpc import ReadinessHealthServicer
from protos.tokenmill.v1 import generation_pb2_grpc

if TYPE_CHECKING:
    from aiohttp import web

    from gateway.apis.openai.http import OpenAIHTTP

logger = logging.getLogger("tokenmill.gateway")
# beyond the scheduler wait, how long a --processes gateway's other processes may take to start, or to exit
# after their drain
CHILD_START_S = 60.0

# the calls that start generation: refused (UNAVAILABLE) on SIGTERM while the in-flight ones are awaited
GENERATING_METHODS = ["/tokenmill.v1.Generation/Generate", "/inference.GRPCInferenceService/ModelInfer",
                      "/inference.GRPCInferenceService/ModelStreamInfer"]


def build_parser() -> argparse.ArgumentParser:
    return GatewayOptions.service_parser("gateway.main", __doc__, add_process_arguments)


def parse_args(argv: list[str] | None = None) -> GatewayOptions:
    parser = build_parser()
    args = parser.parse_args(argv)
    schedulers = tuple(args.scheduler or (() if args.scheduler_dns else (DEFAULT_SCHEDULER,)))
    server_tls = tls.server_tls_from_args(parser, args)
    scheduler_tls = tls.client_tls_from_args(parser, args, "scheduler")
    connections = http_connections.limits_from_args(args)
    secret = internal_secret.secret_from_args(parser, args)
    if secret and (len(schedulers) != 1 or args.scheduler_dns):
        parser.error("the internal secret ($TOKENMILL_INTERNAL_SECRET or --internal-secret-file) is sent to one "
                     "--scheduler only; with several replicas (--scheduler-dns, --scheduler repeated) use mutual TLS")
    return GatewayOptions.from_args(args, scheduler=schedulers, tls=server_tls, scheduler_tls=scheduler_tls,
                                    http_connections=connections, internal_secret=secret,
                                    max_message_bytes=args.max_message_bytes, metrics_port=args.metrics_port)


def scheduler_client(options: GatewayOptions) -> SchedulerTarget:
    """One replica: a plain SchedulerClient; several (or a DNS name): a router that balances them."""
    if len(options.scheduler) == 1 and not options.scheduler_dns:
        return SchedulerClient(options.scheduler[0], tls=options.scheduler_tls, delta_stream=options.delta_stream,
                               internal_secret=options.internal_secret)
    from gateway.upstream.replica_router import ReplicaRouter

    return ReplicaRouter(list(options.scheduler), dns_name=options.scheduler_dns, redis_url=options.redis_url,
                         dns_refresh_s=options.scheduler_dns_refresh_s,
                         max_load_imbalance=options.replica_max_load_imbalance, tls=options.scheduler_tls,
                         delta_stream=options.delta_stream)


async def wait_for_model(options: GatewayOptions, generations: Generations) -> ServedModel:
    scheduler, tokenizer = generations.scheduler, generations.tokenizer
    logger.info("gateway waiting for scheduler %s", scheduler.address)
    model_info = await scheduler.wait_ready(options.scheduler_timeout_s)
    set_model_name(model_info.model_config.name)
    set_server_address(options.host, options.port)  # server.address / server.port on request spans
    # the worker knows the weights; the chat template lives with the tokenizer, which is ours
    model_info.model_config.has_chat_template = bool(tokenizer.chat_template)
    limits = Limits(max_model_len=model_info.model_config.max_context_length, vocab_size=tokenizer.vocab_size,
                    max_tokens_limit=options.max_tokens_limit, default_max_tokens=options.default_max_tokens)
    return ServedModel(generations, model_info, limits)


@dataclass(slots=True)
class FrontDoors:
    """The gRPC server (tokenmill.v1 and KServe v2) and the OpenAI-compatible HTTP API (None when off),
    started, drained and stopped together."""

    server: grpc.aio.Server
    drain: DrainInterceptor
    health: ReadinessHealthServicer
    http_api: OpenAIHTTP | None = None
    http_runner: web.AppRunner | None = None

    async def start(self) -> None:
        await self.server.start()
        await self.health.set_ready(True)

    async def drain_requests(self, timeout_s: float) -> int:
        """New requests refused and readiness off first, so load balancers stop sending; then the
        in-flight requests get timeout_s. Returns how many the timeout cut."""
        self.drain.refuse_new()
        if self.http_api is not None:
            self.http_api.refuse_new()
        await self.health.enter_graceful_shutdown()
        logger.info("gateway draining")
        draining = [self.drain.drain(timeout_s)]
        if self.http_api is not None:
            draining.append(self.http_api.drain(timeout_s))
        return sum(await asyncio.gather(*draining))

    async def stop(self) -> None:
        stopping = [self.server.stop(grace=1.0)]
        if self.http_runner is not None:
            stopping.append(self.http_runner.cleanup())
        await asyncio.gather(*stopping)


def grpc_server(options: GatewayOptions, access: AccessControl) -> FrontDoors:
    """Listening (not yet serving) on --host:--port; on SIGTERM the drain refuses what starts generation."""
    drain = DrainInterceptor(GENERATING_METHODS)
    # a draining gateway answers UNAVAILABLE without checking the key or spending a rate-limit token
    # SO_REUSEPORT only where the gateway's processes share the port: else a port in use is an error
    sharing = [("grpc.so_reuseport", int(options.reuse_port))]
    server = rpc.create_server(interceptors=[drain, AccessInterceptor(access, skip=drain.refuses)],
                               options=server_options(message_size_options(options.max_message_bytes) + sharing,
                                                      max_connection_age_s=options.max_connection_age_s))
    from gateway.apis.kserve import KSERVE_SERVICE  # not at the top: tritonclient (its doc)

    health = rpc.add_health_and_reflection(server, [rpc.GENERATION_SERVICE, KSERVE_SERVICE],
                                           reflection_on=options.reflection)
    address = f"{options.host}:{options.port}"
    if tls.listen(server, address, options.tls) == 0:
        raise SystemExit(f"gateway: cannot listen on {address} (in use?); change --port")
    return FrontDoors(server, drain, health)


async def add_apis(doors: FrontDoors, options: GatewayOptions, model: ServedModel, access: AccessControl,
                   constraints: GrammarSandbox) -> None:
    """The three APIs on the model, each starting its generations through model.generations: tokenmill.v1
    and KServe v2 on the gRPC server, OpenAI over HTTP."""
    from gateway.apis.kserve import add_kserve_servicer

    servicer = GenerationServicer(model, access, constraints)
    servicer.stream_idle_timeout_s = options.stream_idle_timeout_s
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, doors.server)
    kserve = add_kserve_servicer(doors.server, model, access, constraints)
    kserve.stream_idle_timeout_s = options.stream_idle_timeout_s
    if not options.http_port:
        return
    from gateway.apis.openai.http import OpenAIHTTP, start_http

    doors.http_api = OpenAIHTTP(model, access, constraints, api_key=options.http_api_key,
                                stream_idle_timeout_s=options.stream_idle_timeout_s,
                                tool_call_parser=options.tool_call_parser)
    doors.http_runner = await start_http(
        doors.http_api, options.host, options.http_port, ssl_context=options.tls.ssl_context() if options.tls else None,
        max_body_bytes=options.max_message_bytes,
        connections=options.http_connections or http_connections.ConnectionLimits(), reuse_port=options.reuse_port)
    logger.info("gateway HTTP (OpenAI-compatible) on %s:%d", options.host, options.http_port)


async def serve(options: GatewayOptions, group: GatewayGroup | None = None,
                on_ready: Callable[[], None] | None = None) -> None:
    """group: the other processes of a --processes gateway, when this is its process 0 (None: the only one,
    or another's child). on_ready: called once this one serves (a child tells its process 0)."""
    metrics_server = await telemetry.start_process("gateway", options.metrics_port, options.host)  # before any channel
    redis = RedisReaders(options.redis_url, scheduler_wait_s=options.scheduler_resume_wait_s)
    await redis.start()
    tokenizer = await asyncio.to_thread(load_tokenizer, options.model)
    constraints = GrammarSandbox(options.model or default_model_path(), num_helpers=options.grammar_helpers,
                                 timeout_s=options.grammar_timeout_s, memory_mb=options.grammar_memory_mb)
    await constraints.start()  # the helpers load the vocabulary now, not on the first constrained request
    scheduler = scheduler_client(options)
    # the one route choice, for every API; with Redis it records the requests a scheduler loses
    generations = Generations(tokenizer, scheduler, redis.state_reader, redis.resume, options.stream_interval)
    access = build_access(options)
    doors = grpc_server(options, access)
    model = await wait_for_model(options, generations)
    await add_apis(doors, options, model, access, constraints)
    if group is not None:  # readiness says all of them: the port answers SERVING once every process serves
        await group.wait_ready(options.scheduler_timeout_s + CHILD_START_S)
    settle_heap()  # before the doors open: the first requests must not wait for its collection
    await doors.start()
    logger.info("gateway ready on %s:%d serving %s (pid %d)", options.host, options.port,
                model.info.model_config.name, os.getpid())
    if on_ready is not None:
        on_ready()
    await wait_for_stop_signal()
    if group is not None:
        group.stop()  # each drains its own streams beside this one
    cut = await doors.drain_requests(options.drain_timeout_s)
    generations.shutting_down = True  # what the servers' stops cut now is ours, not the clients' cancels
    await doors.stop()
    await scheduler.close()
    await constraints.close()
    if group is not None:
        await group.wait_exited(options.drain_timeout_s + CHILD_START_S)
    if cut and metrics_server is not None and options.metrics_linger_s > 0:
        # the cut requests' endings were counted just now, in this process's registry: without a scrape
        # before exit, no dashboard would ever see a drain that lost streams
        logger.info("%d requests cut by the drain; metrics stay up %.1fs for a last scrape", cut,
                    options.metrics_linger_s)
        await asyncio.sleep(options.metrics_linger_s)
    await redis.aclose()


def serve_child(options: GatewayOptions, index: int, ready: Connection) -> None:
    """A spawned process of a --processes gateway (gateway.processes): serves until SIGTERM, which its
    process 0 passes on (or the kernel sends if process 0 dies), and sends its pid on ready once it serves."""
    watch_parent()

    def on_ready() -> None:
        ready.send(os.getpid())
        ready.close()

    run_process(serve(options, on_ready=on_ready))


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    count = process_count(options)
    if count == 1:
        run_process(serve(replace(options, processes=1)))
        return
    group = GatewayGroup(options, count, serve_child)
    group.start()
    run_process(serve(child_options(options, 0), group))


if __name__ == "__main__":
    main()
