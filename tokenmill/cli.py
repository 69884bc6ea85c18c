"""The `tokenmill` command: serve, generate, bench, bench-engine, bench-cluster.

    tokenmill serve [--model PATH] [--gateway-port 50051] [--http-port 8000] ...
                                                                start redis, worker, scheduler, gateway
    tokenmill generate "PROMPT" [--chat] [--max-tokens N] ...   stream a completion from a running cluster
    tokenmill bench [...]                                       the standard benchmark (sweep, reports, plots)
    tokenmill bench-engine [...]                                in-process engine vs transformers
    tokenmill bench-cluster [...]                               through the gateway vs in-process
    tokenmill bench-tracing [...]                               tracing off vs every request traced

Nothing here imports torch: serve and generate start in well under a second.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from tokenmill.cluster import torch_thread_env

# Subcommands whose own module parses their arguments (the module is imported only when used).
DELEGATED: dict[str, tuple[str, str]] = {
    "bench-engine": ("tokenmill.bench_engine", "in-process engine vs transformers generate (loads torch)"),
    "bench-cluster": ("tokenmill.bench_cluster", "the engine workload through the gateway over gRPC vs in-process"),
    "bench": ("tokenmill.bench.cli", "the standard benchmark: paged vs static vs transformers, tables and plots"),
    "bench-tracing": ("tokenmill.bench_tracing", "throughput with tracing off vs every request traced"),
}
DTYPES = ("float32", "bfloat16", "float16")


def _ranged(kind: Callable, low=None, high=None, low_open: bool = False, what: str = "") -> Callable:
    """An argparse type that names the value and the allowed range when it rejects one."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range: must be {what}")
        return value

    return parse


PORT = _ranged(int, 0, 65535, what="a port in 0..65535 (0 picks a free one)")
POSITIVE = _ranged(int, 1, what=">= 1")
NON_NEGATIVE_FLOAT = _ranged(float, 0.0, what=">= 0")
PROBABILITY = _ranged(float, 0.0, 1.0, low_open=True, what="in (0, 1]")
def POWER_OF_TWO(text: str) -> int:  # noqa: N802 - reads like the other argument types
    value = POSITIVE(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"{value} is not a power of two (the worker requires one)")
    return value


SEED = _ranged(int, 0, 2**64 - 1, what="in 0..2^64-1")
TOP_K = _ranged(int, -1, what=">= -1 (-1 or 0 disables)")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--host", default="127.0.0.1", help="where the gRPC servers listen (default: %(default)s)")
    parser.add_argument("--gateway-port", type=PORT, default=50051, help="public API; 0 picks a free port (default: %(default)s)")
    parser.add_argument("--scheduler-port", type=PORT, default=50052, help="(default: %(default)s)")
    parser.add_argument("--worker-port", type=PORT, default=50053, help="(default: %(default)s)")
    http = parser.add_mutually_exclusive_group()
    http.add_argument("--http-port", type=PORT, default=8000,
                      help="OpenAI-compatible HTTP API on the gateway; 0 picks a free port (default: %(default)s)")
    http.add_argument("--no-http", action="store_true", help="no HTTP API, gRPC only")
    redis = parser.add_mutually_exclusive_group()
    redis.add_argument("--redis-url", help="use this Redis instead of starting redis-server")
    redis.add_argument("--redis-port", type=PORT, default=6379,
                       help="port of the redis-server started here; 0 picks a free one (default: %(default)s)")
    parser.add_argument("--kv-policy", choices=("paged", "static"), default="paged")
    parser.add_argument("--queue-policy", choices=("fcfs", "priority"), default="fcfs")
    parser.add_argument("--block-size", type=POWER_OF_TWO, default=16, help="tokens per KV page (default: %(default)s)")
    parser.add_argument("--kv-cache-mb", type=POSITIVE, default=512, help="KV cache memory (default: %(default)s)")
    parser.add_argument("--num-blocks", type=POSITIVE, help="KV pages; overrides --kv-cache-mb")
    parser.add_argument("--max-num-seqs", type=POSITIVE, default=64, help="batch size limit (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=POSITIVE, default=512,
                        help="token budget per step (default: %(default)s)")
    parser.add_argument("--max-model-len", type=POSITIVE, help="context limit (default: the model's)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--no-metrics", action="store_true", help="no Prometheus /metrics endpoints")
    parser.add_argument("--gateway-metrics-port", type=PORT, default=9400,
                        help="Prometheus /metrics of the gateway; 0 picks a free port (default: %(default)s)")
    parser.add_argument("--scheduler-metrics-port", type=PORT, default=9401, help="(default: %(default)s)")
    parser.add_argument("--worker-metrics-port", type=PORT, default=9402, help="(default: %(default)s)")
    parser.add_argument("--startup-timeout-s", type=_ranged(float, 0.0, low_open=True, what="> 0"), default=300.0,
                        help="how long each component may take to become ready (default: %(default)s)")
    parser.add_argument("--grace-period-s", type=NON_NEGATIVE_FLOAT, default=10.0,
                        help="per component, between SIGTERM and SIGKILL at shutdown (default: %(default)s)")


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help='the prompt ("-" reads it from stdin)')
    parser.add_argument("--address", default="127.0.0.1:50051", help="the gateway (default: %(default)s)")
    parser.add_argument("--max-tokens", type=POSITIVE)
    parser.add_argument("--temperature", type=NON_NEGATIVE_FLOAT, help="0 is greedy (server default: 1)")
    parser.add_argument("--top-p", type=PROBABILITY)
    parser.add_argument("--top-k", type=TOP_K)
    parser.add_argument("--seed", type=SEED)
    parser.add_argument("--stop", action="extend", nargs="+", default=[], metavar="S",
                        help="strings that end generation (repeatable)")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user turn (chat template)")
    parser.add_argument("--system", help="system message; implies --chat")
    parser.add_argument("--no-stream", action="store_true", help="one Generate call instead of a stream")
    parser.add_argument("--connect-timeout-s", type=NON_NEGATIVE_FLOAT, default=5.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference serving cluster.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_serve_arguments(commands.add_parser(
        "serve", help="start redis-server, worker, scheduler and gateway; Ctrl-C stops them",
        description="Starts redis-server, worker, scheduler and gateway as child processes, each once the "
                    "previous is ready, and stops them in reverse order on Ctrl-C or SIGTERM."))
    add_generate_arguments(commands.add_parser(
        "generate", help="stream a completion from a running cluster",
        description="Streams a completion from a running gateway; text on stdout, a summary on stderr."))
    for name, (_, help_text) in DELEGATED.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def serve(args: argparse.Namespace) -> int:
    from tokenmill.cluster import ClusterConfig, cluster_specs, resolve_ports
    from tokenmill.readiness import port_in_use
    from tokenmill.supervisor import PortInUse, Supervisor, SupervisorError, run_until_stopped

    if args.model is not None and not os.path.exists(args.model):
        print(f"error: --model {args.model}: no such file or directory", file=sys.stderr)
        return 2
    config = resolve_ports(ClusterConfig(
        model=args.model, dtype=args.dtype, host=args.host, gateway_port=args.gateway_port,
        http_port=None if args.no_http else args.http_port,
        scheduler_port=args.scheduler_port, worker_port=args.worker_port, redis_url=args.redis_url,
        redis_port=args.redis_port, kv_policy=args.kv_policy, queue_policy=args.queue_policy,
        block_size=args.block_size, kv_cache_mb=args.kv_cache_mb, num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        **({} if args.no_metrics else {"gateway_metrics_port": args.gateway_metrics_port,
                                       "scheduler_metrics_port": args.scheduler_metrics_port,
                                       "worker_metrics_port": args.worker_metrics_port})))
    try:
        specs = cluster_specs(config)
    except FileNotFoundError as error:  # no redis-server binary
        print(f"error: {error}", file=sys.stderr)
        return 2
    supervisor = Supervisor(specs, startup_timeout_s=args.startup_timeout_s, grace_s=args.grace_period_s)
    try:
        supervisor.check_ports()
        if config.http_port is not None and port_in_use(f"{config.host}:{config.http_port}"):
            raise PortInUse("gateway HTTP", f"{config.host}:{config.http_port}", "--http-port (or --no-http)")
        for name in ("gateway", "scheduler", "worker"):
            port = getattr(config, f"{name}_metrics_port")
            if port is not None and port_in_use(f"{config.host}:{port}"):
                raise PortInUse(f"{name} metrics", f"{config.host}:{port}", f"--{name}-metrics-port (or --no-metrics)")
    except SupervisorError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1

    def on_ready() -> None:
        rows = [("gateway", config.gateway_address)]
        if config.http_address:
            rows.append(("http", f"http://{config.http_address}/v1  (OpenAI-compatible)"))
        rows += [("scheduler", config.scheduler_address), ("worker", config.worker_address),
                 ("redis", config.effective_redis_url + ("" if config.redis_url is None else " (external)"))]
        if config.gateway_metrics_port is not None:
            rows.append(("metrics", ", ".join(f"http://{config.host}:{port}/metrics" for port in (
                config.gateway_metrics_port, config.scheduler_metrics_port, config.worker_metrics_port))))
        print("\n".join(f"{name:<10} {address}" for name, address in rows))
        print(f'ready: try  tokenmill generate "Hello" --address {config.gateway_address}', flush=True)

    return run_until_stopped(supervisor, on_ready)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # before torch (and its OpenMP) loads in this process: see cluster.torch_thread_env
    os.environ.update(torch_thread_env())
    if argv and argv[0] in DELEGATED:  # its own parser sees every remaining argument, --help included
        import importlib

        return importlib.import_module(DELEGATED[argv[0]][0]).main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    from tokenmill.client_cli import GenerateOptions, generate

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    return generate(GenerateOptions(
        prompt=prompt, address=args.address, chat=args.chat or args.system is not None, system=args.system,
        stream=not args.no_stream, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=args.stop, connect_timeout_s=args.connect_timeout_s))


if __name__ == "__main__":
    sys.exit(main())
