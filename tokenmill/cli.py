"""The `tokenmill` command: serve, generate, hash-api-key, bench, bench-engine, bench-cluster.

    tokenmill serve [--model PATH] [--gateway-port 50051] [--http-port 8000] ...
                                                                start redis, worker, scheduler, gateway
    tokenmill generate "PROMPT" [--chat] [--max-tokens N] ...   stream a completion from a running cluster
    tokenmill hash-api-key [KEY] [--name NAME]                  a line for the gateway's --api-keys-file
    tokenmill bench [...]                                       the standard benchmark (sweep, reports, plots)
    tokenmill bench-engine [...]                                in-process engine vs transformers
    tokenmill bench-cluster [...]                               through the gateway vs in-process
    tokenmill bench-stack [...]                                 near-free model: cluster vs in-process, per-process CPU
    tokenmill bench-tracing [...]                               tracing off vs every request traced

Nothing here imports torch: serve and generate start in well under a second.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from plumbing.options import NON_NEGATIVE_FLOAT, PORT, POSITIVE, POSITIVE_FLOAT, PROBABILITY, SEED, TOP_K
from tokenmill.cluster.config import ClusterConfig, resolve_ports
from tokenmill.cluster.specs import torch_thread_env

# Subcommands whose own module parses their arguments (the module is imported only when used).
DELEGATED: dict[str, tuple[str, str]] = {
    "bench-engine": ("tokenmill.bench.engine", "in-process engine vs transformers generate (loads torch)"),
    "bench-cluster": ("tokenmill.bench.cluster", "the engine workload through the gateway over gRPC vs in-process"),
    "bench": ("tokenmill.bench.cli", "the standard benchmark: paged vs static vs transformers, tables and plots"),
    "bench-stack": ("tokenmill.bench.stack", "the stack's ceiling: a near-free model in-process vs through the "
                    "cluster at 64-1024 streams, with each process's CPU per token"),
    "bench-tracing": ("tokenmill.bench.tracing", "throughput with tracing off vs every request traced"),
    "accuracy": ("tokenmill.bench.accuracy", "greedy agreement and perplexity of each weight format / dtype vs float32"),
}


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster's flags and each service's (tokenmill.cluster.config), then what this process takes itself."""
    from tokenmill.cluster.config import ClusterConfig

    ClusterConfig.add_arguments(parser)
    parser.add_argument("--supervisor-metrics-port", type=PORT, default=9403,
                        help="this process's own /metrics: each child up, its restarts, and whether it is "
                             "crash-looping (default: %(default)s)")
    parser.add_argument("--startup-timeout-s", type=POSITIVE_FLOAT, default=300.0,
                        help="how long each component may take to become ready (default: %(default)s)")
    parser.add_argument("--grace-period-s", type=NON_NEGATIVE_FLOAT, default=10.0,
                        help="per component, between SIGTERM and SIGKILL at shutdown (default: %(default)s)")
    add_serve_security_arguments(parser)


def add_serve_security_arguments(parser: argparse.ArgumentParser) -> None:
    from plumbing.message_size import PUBLIC_MAX_MESSAGE_BYTES, add_message_size_argument

    parser.add_argument("--redis-user", help="ACL user of the redis-server started here (needs --redis-password-file)")
    parser.add_argument("--redis-password-file", help="file whose first line is the password of the redis-server "
                        "started here (requirepass, or the --redis-user's)")
    add_message_size_argument(parser, PUBLIC_MAX_MESSAGE_BYTES)
    tls = parser.add_argument_group("TLS on every gRPC link, one CA for the cluster (docs/security.md)")
    tls.add_argument("--tls-ca", help="PEM CA that signed every certificate below")
    tls.add_argument("--tls-cert", help="PEM server certificate of gateway, scheduler and worker (SAN: the hosts)")
    tls.add_argument("--tls-key", help="PEM private key of --tls-cert")
    tls.add_argument("--tls-client-cert", help="PEM client certificate: set, every server requires one signed by "
                     "--tls-ca (mutual TLS) and the gateway and scheduler present this one")
    tls.add_argument("--tls-client-key", help="PEM private key of --tls-client-cert")


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
    parser.add_argument("--tls-ca", help="PEM CA that signed the gateway's certificate (turns TLS on)")
    parser.add_argument("--tls-cert", help="PEM client certificate, for a gateway that requires one")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")


def add_hash_api_key_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("key", nargs="?", help='the key ("-" reads it from stdin); omitted: a new random key')
    parser.add_argument("--name", default="default", help="the key's name in logs and messages (default: %(default)s)")
    parser.add_argument("--requests-per-s", type=POSITIVE_FLOAT,
                        help="this key's rate limit (default: the gateway's --rate-limit-rps)")
    parser.add_argument("--burst", type=POSITIVE, help="this key's burst (default: the gateway's)")
    parser.add_argument("--target-itl-ms", type=POSITIVE_FLOAT,
                        help="this key's inter-token latency target, its class of service (default: the "
                             "scheduler's --target-itl-ms)")
    parser.add_argument("--target-ttft-ms", type=POSITIVE_FLOAT,
                        help="this key's time-to-first-token target (default: the scheduler's --target-ttft-ms)")


def hash_api_key_command(args: argparse.Namespace) -> int:
    import json
    import secrets

    from gateway.access.api_keys import hash_api_key

    key = sys.stdin.readline().strip() if args.key == "-" else args.key
    if key is None:
        key = "tm-" + secrets.token_urlsafe(32)
        print(f"API key (shown only now): {key}", file=sys.stderr)
    if not key or key != key.strip() or " " in key:
        print("error: the key must be non-empty, without spaces", file=sys.stderr)
        return 2
    line = {"name": args.name, "sha256": hash_api_key(key)}
    if args.requests_per_s is not None:
        line["requests_per_s"] = args.requests_per_s
    if args.burst is not None:
        line["burst"] = args.burst
    for field in ("target_itl_ms", "target_ttft_ms"):
        if getattr(args, field) is not None:
            line[field] = getattr(args, field)
    print(json.dumps(line))
    return 0


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
    add_hash_api_key_arguments(commands.add_parser(
        "hash-api-key", help="print a keys-file line (name + SHA-256) for an API key",
        description="Prints the JSON line --api-keys-file takes for a key; with no key, makes a random one "
                    "and prints it on stderr (the only time it is shown)."))
    for name, (_, help_text) in DELEGATED.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


def serve(args: argparse.Namespace) -> int:
    from tokenmill.cluster.specs import cluster_specs, restart_policies
    from tokenmill.cluster.supervisor import Supervisor, SupervisorError, run_until_stopped

    if args.model is not None and not os.path.exists(args.model):
        print(f"error: --model {args.model}: no such file or directory", file=sys.stderr)
        return 2
    try:
        config = resolve_ports(ClusterConfig.from_args(args, **serve_security_options(args)))
        specs = cluster_specs(config)
    except (FileNotFoundError, ValueError) as error:  # TLSConfigError; no redis-server binary; a password
        print(f"error: {error}", file=sys.stderr)     # redis.conf cannot hold
        return 2
    # crashed worker/scheduler/gateway (and our own redis-server) are restarted with backoff; the
    # grace period covers the drain
    supervisor = Supervisor(specs, startup_timeout_s=args.startup_timeout_s,
                            grace_s=max(args.grace_period_s, args.drain_timeout_s + 5.0),
                            restart_policies=restart_policies(redis=config.redis_url is None))
    supervisor_metrics_port = None if args.no_metrics else args.supervisor_metrics_port
    try:
        check_serve_ports(supervisor, config, supervisor_metrics_port)
    except SupervisorError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    metrics_server = None
    if supervisor_metrics_port is not None:
        from tokenmill.cluster.supervisor_metrics import serve_supervisor_metrics

        metrics_server = serve_supervisor_metrics(supervisor, config.host, supervisor_metrics_port)
    try:
        return run_until_stopped(supervisor, lambda: print_ready(supervisor, config, metrics_server))
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()


def check_serve_ports(supervisor, config: ClusterConfig, supervisor_metrics_port: int | None) -> None:
    """Raises PortInUse, naming the flag to change, for a taken port before anything starts."""
    from tokenmill.cluster.readiness import port_in_use
    from tokenmill.cluster.supervisor import PortInUse

    supervisor.check_ports()
    if config.http_port is not None and port_in_use(f"{config.host}:{config.http_port}"):
        raise PortInUse("gateway HTTP", f"{config.host}:{config.http_port}", "--http-port (or --no-http)")
    for name in ("gateway", "scheduler", "worker"):
        port = getattr(config, f"{name}_metrics_port")
        if port is not None and port_in_use(f"{config.host}:{port}"):
            raise PortInUse(f"{name} metrics", f"{config.host}:{port}", f"--{name}-metrics-port (or --no-metrics)")
    if supervisor_metrics_port and port_in_use(f"{config.host}:{supervisor_metrics_port}"):
        raise PortInUse("supervisor metrics", f"{config.host}:{supervisor_metrics_port}",
                        "--supervisor-metrics-port (or --no-metrics)")


def print_ready(supervisor, config: ClusterConfig, metrics_server) -> None:
    """Where everything listens, and a command to try it."""
    from kvstore.credentials import redact_url

    rows = [("gateway", config.gateway_address)]
    if config.http_address:
        scheme = "https" if config.tls else "http"
        rows.append(("http", f"{scheme}://{config.http_address}/v1  (OpenAI-compatible)"))
    rows += [("scheduler", config.scheduler_address), ("worker", config.worker_address),
             ("redis", redact_url(config.effective_redis_url) + ("" if config.redis_url is None else " (external)"))]
    if config.gateway_metrics_port is not None:
        rows.append(("metrics", ", ".join(f"http://{config.host}:{port}/metrics" for port in (
            config.gateway_metrics_port, config.scheduler_metrics_port, config.worker_metrics_port))))
    if metrics_server is not None:
        rows.append(("children", f"http://{config.host}:{metrics_server.server_port}/metrics  (up, restarts, "
                                 "crash-looping)"))
    tls_flags = ""
    if config.tls:
        tls_flags = f" --tls-ca {config.tls.ca}" + (
            f" --tls-cert {config.tls.client_cert} --tls-key {config.tls.client_key}" if config.tls.mutual else "")
    ready = f'ready: try  tokenmill generate "Hello" --address {config.gateway_address}{tls_flags}'
    if any(child.json_lines for child in supervisor.children.values()):  # keep the output JSON lines
        print("\n".join(supervisor.own_line(f"{name} {address}".strip()) for name, address in [*rows, ("", ready)]),
              flush=True)
        return
    print("\n".join(f"{name:<10} {address}" for name, address in rows))
    print(ready, flush=True)


def serve_security_options(args: argparse.Namespace) -> dict:
    """ClusterConfig fields from serve's TLS, Redis credential and message size flags; raises
    ValueError naming the flag when they cannot work."""
    from plumbing.internal_secret import new_secret
    from plumbing.tls import ClusterTLS

    # scheduler and worker admit only this cluster's gateway and scheduler (plumbing.internal_secret)
    options: dict = {"max_message_bytes": args.max_message_bytes, "internal_secret": new_secret()}
    if args.redis_user and not args.redis_password_file:
        raise ValueError("--redis-user needs --redis-password-file")
    if (args.redis_user or args.redis_password_file) and args.redis_url:
        raise ValueError("--redis-user/--redis-password-file set up the redis-server started here; "
                         "put the credentials of an external Redis in --redis-url (redis://USER:PASSWORD@HOST:PORT/DB)")
    if args.redis_password_file:
        try:
            with open(args.redis_password_file) as file:
                password = file.readline().strip()
        except OSError as error:
            raise ValueError(f"--redis-password-file {args.redis_password_file}: {error.strerror}") from None
        if not password:
            raise ValueError(f"--redis-password-file {args.redis_password_file}: the first line is empty")
        options.update(redis_user=args.redis_user, redis_password=password)
    server_files = (args.tls_ca, args.tls_cert, args.tls_key)
    client_files = (args.tls_client_cert, args.tls_client_key)
    if any(server_files) or any(client_files):
        if not all(server_files):
            raise ValueError("TLS needs all of --tls-ca, --tls-cert and --tls-key")
        if any(client_files) and not all(client_files):
            raise ValueError("--tls-client-cert and --tls-client-key go together")
        tls = ClusterTLS(args.tls_ca, args.tls_cert, args.tls_key, args.tls_client_cert, args.tls_client_key)
        tls.server().credentials()  # reads every file now: a wrong path fails before anything starts
        tls.client().credentials()
        options["tls"] = tls
    return options


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
    if args.command == "hash-api-key":
        return hash_api_key_command(args)
    from tokenmill.client_cli import GenerateOptions, generate

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    return generate(GenerateOptions(
        prompt=prompt, address=args.address, chat=args.chat or args.system is not None, system=args.system,
        stream=not args.no_stream, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=args.stop, connect_timeout_s=args.connect_timeout_s,
        tls=generate_tls(args)))


def generate_tls(args: argparse.Namespace):
    """ClientTLS for `generate` (None: plaintext); TLS with the system's roots when only a cert is given."""
    from plumbing.tls import ClientTLS

    if not (args.tls_ca or args.tls_cert or args.tls_key):
        return None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SystemExit("error: --tls-cert and --tls-key go together")
    return ClientTLS(args.tls_ca, args.tls_cert, args.tls_key)


if __name__ == "__main__":
    sys.exit(main())
