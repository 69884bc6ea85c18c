"""The gateway process: `python -m gateway.main --scheduler HOST:PORT --model PATH ...`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os

from gateway.apis.openai import http_connections
from gateway.access.control import AccessInterceptor, add_access_arguments, build_access
from gateway.generation.ownership import RequestOwners
from gateway.generation.resume import SCHEDULER_RESUME_WAIT_S, ResumeStore
from gateway.upstream.scheduler_client import SchedulerClient
from gateway.apis.generation import GenerationServicer
from gateway.text.tokenizer import default_model_path, load_tokenizer
from gateway.text.tool_syntax import TOOL_CALL_PARSERS
from gateway.prepare.validation import Limits
from protos.tokenmill.v1 import generation_pb2_grpc
from plumbing import internal_secret, rpc, telemetry, tls
from plumbing.drain import DrainInterceptor
from plumbing.grammar_sandbox import GrammarSandbox
from plumbing.keepalive import server_options
from plumbing.message_size import PUBLIC_MAX_MESSAGE_BYTES, add_message_size_argument, message_size_options
from gateway.telemetry import set_model_name, set_server_address
from plumbing.process import run_process, wait_for_stop_signal

logger = logging.getLogger("tokenmill.gateway")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway.main", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--scheduler", action="append", default=None,
                        help="scheduler address HOST:PORT; repeat for several model replicas (default 127.0.0.1:50052)")
    parser.add_argument("--scheduler-dns", default="", help="HOST:PORT whose every address is a model replica "
                        "(a Kubernetes headless Service), re-resolved every --scheduler-dns-refresh-s")
    parser.add_argument("--scheduler-dns-refresh-s", type=float, default=10.0)
    parser.add_argument("--replica-max-load-imbalance", type=float, default=4.0,
                        help="requests more than the least loaded replica a prefix-holding replica may have")
    parser.add_argument("--redis-url", default=os.environ.get("TOKENMILL_REDIS_URL", ""),
                        help="answers GetRequestStatus, redis://[USER:PASSWORD@]HOST:PORT/DB (default: "
                             "$TOKENMILL_REDIS_URL); empty: status unavailable")
    parser.add_argument("--model", default=None, help="the model's GGUF file or HF folder (for its tokenizer)")
    parser.add_argument("--max-tokens-limit", type=int, default=4096)
    parser.add_argument("--default-max-tokens", type=int, default=256)
    parser.add_argument("--scheduler-timeout-s", type=float, default=600.0)
    parser.add_argument("--drain-timeout-s", "--drain-timeout", type=float, default=30.0,
                        help="on SIGTERM: readiness off, new requests UNAVAILABLE, in-flight ones get this long")
    parser.add_argument("--metrics-linger-s", type=float, default=15.0,
                        help="when the drain timeout cut requests, /metrics stays up this long after the cut (one "
                             "scrape interval), so their drained endings are scraped before the process exits; "
                             "a drain that cut nothing exits at once; 0: never wait")
    parser.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API; 0 disables")
    parser.add_argument("--http-api-key", default="", help="HTTP clients must send 'Authorization: Bearer KEY'")
    http_connections.add_arguments(parser)  # --http-header-timeout-s, --http-keepalive-timeout-s, per-client cap
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                        help="how the model writes tool calls (OpenAI chat tools): hermes (<tool_call> JSON: "
                             "Qwen2.5, Hermes) or llama3_json (Llama 3.1+); auto reads the chat template")
    parser.add_argument("--stream-idle-timeout-s", type=float, default=120.0,
                        help="a streaming call (GenerateStream, KServe ModelStreamInfer, HTTP stream=true) whose "
                             "client has read nothing for this long (its messages back up under flow control) is "
                             "cancelled (gRPC CANCELLED; HTTP: the connection is reset), its pages freed and its "
                             "record failed with the reason; 0 disables")
    parser.add_argument("--scheduler-resume-wait-s", type=float, default=SCHEDULER_RESUME_WAIT_S,
                        help="with Redis, a stream (every API) whose scheduler goes away mid-request waits this "
                             "long for the restarted scheduler to go on with it (it re-admits the request) and "
                             "continues from Redis without a lost or repeated token; 0: it ends UNAVAILABLE at once")
    parser.add_argument("--max-connection-age-s", type=float, default=1800.0,
                        help="gRPC connections older than this get GOAWAY (calls in flight finish first), so "
                             "clients behind a load balancer spread over new replicas; 0 disables")
    parser.add_argument("--grammar-helpers", type=int, default=2,
                        help="helper processes that compile clients' output constraints (JSON schemas, regexes, "
                             "grammars) off the event loop; a constraint that crashes or overruns one costs that "
                             "helper only (plumbing.grammar_sandbox)")
    parser.add_argument("--grammar-timeout-s", type=float, default=5.0,
                        help="a constraint whose compile takes longer is refused (400 naming the limit)")
    parser.add_argument("--grammar-memory-mb", type=int, default=1024,
                        help="address-space cap of each grammar helper; a constraint needing more is refused")
    add_message_size_argument(parser, PUBLIC_MAX_MESSAGE_BYTES)
    tls.add_server_arguments(parser)  # the HTTP API serves HTTPS with the same files
    parser.add_argument("--no-reflection", action="store_true", help="do not serve gRPC server reflection")
    parser.add_argument("--no-delta-stream", action="store_true",
                        help="each request's tokens come on its own Submit call instead of one StreamDeltas call "
                             "per scheduler carrying a step's tokens for all of them (gateway.upstream.delta_stream)")
    tls.add_client_arguments(parser, "scheduler")
    internal_secret.add_arguments(parser, "sent with every call to the scheduler (one --scheduler only)")
    add_access_arguments(parser)
    telemetry.add_metrics_argument(parser)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.scheduler = args.scheduler or ([] if args.scheduler_dns else ["127.0.0.1:50052"])
    args.tls = tls.server_tls_from_args(parser, args)
    args.scheduler_tls = tls.client_tls_from_args(parser, args, "scheduler")
    args.http_connections = http_connections.limits_from_args(parser, args)
    args.internal_secret = internal_secret.secret_from_args(parser, args)
    if args.internal_secret and (len(args.scheduler) != 1 or args.scheduler_dns):
        parser.error("the internal secret ($TOKENMILL_INTERNAL_SECRET or --internal-secret-file) is sent to one "
                     "--scheduler only; with several replicas (--scheduler-dns, --scheduler repeated) use mutual TLS")
    return args


def scheduler_client(args: argparse.Namespace):
    """One replica: a plain SchedulerClient; several (or a DNS name): a router that balances them."""
    if len(args.scheduler) == 1 and not args.scheduler_dns:
        return SchedulerClient(args.scheduler[0], tls=args.scheduler_tls, delta_stream=not args.no_delta_stream,
                               internal_secret=args.internal_secret)
    from gateway.upstream.replica_router import ReplicaRouter

    return ReplicaRouter(args.scheduler, dns_name=args.scheduler_dns, redis_url=args.redis_url,
                         dns_refresh_s=args.scheduler_dns_refresh_s,
                         max_load_imbalance=args.replica_max_load_imbalance, tls=args.scheduler_tls,
                         delta_stream=not args.no_delta_stream)


def redis_readers(args: argparse.Namespace, scheduler):
    """The gateway's Redis side: request records, and what resume needs (gateway.generation.resume.ResumeStore)."""
    from gateway.generation.lost_requests import LostRequestRecorder
    from kvstore.followers import Followers
    from kvstore.request_claims import RequestClaims
    from kvstore.state_reader import RequestStateReader
    from kvstore.token_streams import TokenStreamReader

    state_reader = RequestStateReader(args.redis_url)
    scheduler.on_request_lost = LostRequestRecorder(state_reader)  # requests without Redis's resume (n > 1)
    resume = ResumeStore(TokenStreamReader(args.redis_url), state_reader, RequestOwners(state_reader),
                         RequestClaims(args.redis_url),  # one request per client-chosen id, across replicas
                         Followers(args.redis_url), scheduler_wait_s=args.scheduler_resume_wait_s)
    return state_reader, resume


async def serve(args: argparse.Namespace) -> None:
    metrics_server = await telemetry.start_process("gateway", args.metrics_port, args.host)  # before any channel
    if args.redis_url:
        from kvstore.credentials import check_redis_credentials

        await check_redis_credentials(args.redis_url, "gateway")
    tokenizer = await asyncio.to_thread(load_tokenizer, args.model)
    constraints = GrammarSandbox(args.model or default_model_path(), num_helpers=args.grammar_helpers,
                                 timeout_s=args.grammar_timeout_s, memory_mb=args.grammar_memory_mb)
    await constraints.start()  # the helpers load the vocabulary now, not on the first constrained request
    scheduler = scheduler_client(args)
    access = build_access(args)
    # on SIGTERM: calls that start generation are refused (UNAVAILABLE) and in-flight ones awaited
    drain = DrainInterceptor(["/tokenmill.v1.Generation/Generate", "/inference.GRPCInferenceService/ModelInfer",
                              "/inference.GRPCInferenceService/ModelStreamInfer"])
    # a draining gateway answers UNAVAILABLE without checking the key or spending a rate-limit token
    server = rpc.create_server(interceptors=[drain, AccessInterceptor(access, skip=drain.refuses)],
                               options=server_options(message_size_options(args.max_message_bytes),
                                                      max_connection_age_s=args.max_connection_age_s))
    from gateway.apis.kserve import KSERVE_SERVICE, add_kserve_servicer  # not at the top: tritonclient (its doc)
    health = rpc.add_health_and_reflection(server, [rpc.GENERATION_SERVICE, KSERVE_SERVICE],
                                           reflection_on=not args.no_reflection)
    address = f"{args.host}:{args.port}"
    if tls.listen(server, address, args.tls) == 0:
        raise SystemExit(f"gateway: cannot listen on {address} (in use?); change --port")
    logger.info("gateway waiting for scheduler %s", scheduler.address)
    model_info = await scheduler.wait_ready(args.scheduler_timeout_s)
    set_model_name(model_info.model_config.name)
    set_server_address(args.host, args.port)  # server.address / server.port on request spans
    # the worker knows the weights; the chat template lives with the tokenizer, which is ours
    model_info.model_config.has_chat_template = bool(tokenizer.chat_template)
    limits = Limits(max_model_len=model_info.model_config.max_context_length, vocab_size=tokenizer.vocab_size,
                    max_tokens_limit=args.max_tokens_limit, default_max_tokens=args.default_max_tokens)
    state_reader = resume = None
    if args.redis_url:
        state_reader, resume = redis_readers(args, scheduler)
    servicer = GenerationServicer(tokenizer, scheduler, limits, model_info, state_reader, resume, access, constraints)
    servicer.stream_idle_timeout_s = args.stream_idle_timeout_s
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    kserve = add_kserve_servicer(server, tokenizer, scheduler, limits, model_info, state_reader, access, constraints)
    kserve.stream_idle_timeout_s = args.stream_idle_timeout_s
    kserve.resume = resume
    http_api = http_runner = None
    if args.http_port:
        from gateway.apis.openai.http import OpenAIHTTP, start_http

        http_api = OpenAIHTTP(tokenizer, scheduler, limits, model_info, api_key=args.http_api_key, access=access,
                              stream_idle_timeout_s=args.stream_idle_timeout_s, state_reader=state_reader,
                              tool_call_parser=args.tool_call_parser, constraints=constraints)
        http_api.resume = resume
        http_runner = await start_http(http_api, args.host, args.http_port,
                                       ssl_context=args.tls.ssl_context() if args.tls else None,
                                       max_body_bytes=args.max_message_bytes, connections=args.http_connections)
        logger.info("gateway HTTP (OpenAI-compatible) on %s:%d", args.host, args.http_port)
    await server.start()
    await health.set_ready(True)
    logger.info("gateway ready on %s serving %s", address, model_info.model_config.name)
    await wait_for_stop_signal()
    # new requests refused and readiness off first, so load balancers stop sending; then in-flight
    # requests get drain_timeout_s
    drain.refuse_new()
    if http_api is not None:
        http_api.refuse_new()
    await health.enter_graceful_shutdown()
    logger.info("gateway draining")
    draining = [drain.drain(args.drain_timeout_s)]
    if http_api is not None:
        draining.append(http_api.drain(args.drain_timeout_s))
    cut = sum(await asyncio.gather(*draining))
    scheduler.shutting_down = True  # what the servers' stops cut now is ours, not the clients' cancels
    stopping = [server.stop(grace=1.0)]
    if http_runner is not None:
        stopping.append(http_runner.cleanup())
    await asyncio.gather(*stopping)
    await scheduler.close()
    await constraints.close()
    if cut and metrics_server is not None and args.metrics_linger_s > 0:
        # the cut requests' endings were counted just now, in this process's registry: without a scrape
        # before exit, no dashboard would ever see a drain that lost streams
        logger.info("%d requests cut by the drain; metrics stay up %.1fs for a last scrape", cut,
                    args.metrics_linger_s)
        await asyncio.sleep(args.metrics_linger_s)
    if state_reader:
        await state_reader.aclose()
        await resume.aclose()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_process(serve(args))


if __name__ == "__main__":
    main()
