"""The gateway process: `python -m gateway.main --scheduler HOST:PORT --model PATH ...`."""
from __future__ import annotations

import argparse
import asyncio
import logging

from gateway.scheduler_client import SchedulerClient
from gateway.service import GenerationServicer
from gateway.tokenizer import load_tokenizer
from gateway.validation import Limits
from protos.tokenmill.v1 import generation_pb2_grpc
from tokenmill import rpc, telemetry
from tokenmill.telemetry.gateway_requests import set_model_name
from tokenmill.process import run_process, wait_for_stop_signal

logger = logging.getLogger("tokenmill.gateway")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m gateway.main", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--scheduler", default="127.0.0.1:50052", help="scheduler address HOST:PORT")
    parser.add_argument("--redis-url", default="", help="answers GetRequestStatus; empty: status unavailable")
    parser.add_argument("--model", default=None, help="the model's GGUF file or HF folder (for its tokenizer)")
    parser.add_argument("--max-tokens-limit", type=int, default=4096)
    parser.add_argument("--default-max-tokens", type=int, default=256)
    parser.add_argument("--scheduler-timeout-s", type=float, default=600.0)
    parser.add_argument("--drain-timeout-s", type=float, default=30.0)
    parser.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API; 0 disables")
    parser.add_argument("--http-api-key", default="", help="HTTP clients must send 'Authorization: Bearer KEY'")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    await telemetry.start_process("gateway", args.metrics_port, args.host)  # before any gRPC channel or server
    tokenizer = await asyncio.to_thread(load_tokenizer, args.model)
    scheduler = SchedulerClient(args.scheduler)
    server = rpc.create_server()
    from gateway.kserve_service import KSERVE_SERVICE, add_kserve_servicer  # not at the top: tritonclient (its doc)
    health = rpc.add_health_and_reflection(server, [rpc.GENERATION_SERVICE, KSERVE_SERVICE])
    address = f"{args.host}:{args.port}"
    if server.add_insecure_port(address) == 0:
        raise SystemExit(f"gateway: cannot listen on {address} (in use?); change --port")
    logger.info("gateway waiting for scheduler %s", args.scheduler)
    model_info = await scheduler.wait_ready(args.scheduler_timeout_s)
    set_model_name(model_info.model_config.name)
    # the worker knows the weights; the chat template lives with the tokenizer, which is ours
    model_info.model_config.has_chat_template = bool(tokenizer.chat_template)
    limits = Limits(max_model_len=model_info.model_config.max_context_length, vocab_size=tokenizer.vocab_size,
                    max_tokens_limit=args.max_tokens_limit, default_max_tokens=args.default_max_tokens)
    state_reader = None
    if args.redis_url:
        from kvstore.state_reader import RequestStateReader

        state_reader = RequestStateReader(args.redis_url)
    servicer = GenerationServicer(tokenizer, scheduler, limits, model_info, state_reader)
    generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
    add_kserve_servicer(server, tokenizer, scheduler, limits, model_info)
    http_api = http_runner = None
    if args.http_port:
        from gateway.openai_http import OpenAIHTTP, start_http

        http_api = OpenAIHTTP(tokenizer, scheduler, limits, model_info, api_key=args.http_api_key)
        http_runner = await start_http(http_api, args.host, args.http_port, args.drain_timeout_s)
        logger.info("gateway HTTP (OpenAI-compatible) on %s:%d", args.host, args.http_port)
    await server.start()
    await health.set_ready(True)
    logger.info("gateway ready on %s serving %s", address, model_info.model_config.name)
    await wait_for_stop_signal()
    await health.enter_graceful_shutdown()
    stopping = [server.stop(grace=args.drain_timeout_s)]  # in-flight streams finish, new calls are refused
    if http_runner is not None:
        http_api.ready = False
        stopping.append(http_runner.cleanup())
    await asyncio.gather(*stopping)
    await scheduler.close()
    if state_reader:
        await state_reader.aclose()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run_process(serve(args))


if __name__ == "__main__":
    main()
