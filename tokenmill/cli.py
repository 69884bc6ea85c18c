"""The `tokenmill` command: serve, generate, hash-api-key, bench, bench-engine, bench-cluster.

    tokenmill serve [--model PATH] [--gateway-port 50051] [--http-port 8000] ...
                                                                start redis, worker, scheduler, gateway
    tokenmill generate "PROMPT" [--chat] [--max-tokens N] ...   stream a completion from a running cluster
    tokenmill hash-api-key [KEY] [--name NAME]                  a line for the gateway's --api-keys-file
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

from tokenmill.cluster.specs import torch_thread_env

# Subcommands whose own module parses their arguments (the module is imported only when used).
DELEGATED: dict[str, tuple[str, str]] = {
    "bench-engine": ("tokenmill.bench.engine", "in-process engine vs transformers generate (loads torch)"),
    "bench-cluster": ("tokenmill.bench.cluster", "the engine workload through the gateway over gRPC vs in-process"),
    "bench": ("tokenmill.bench.cli", "the standard benchmark: paged vs static vs transformers, tables and plots"),
    "bench-tracing": ("tokenmill.bench.tracing", "throughput with tracing off vs every request traced"),
    "accuracy": ("tokenmill.bench.accuracy", "greedy agreement and perplexity of each weight format / dtype vs float32"),
}
DTYPES = ("auto", "float32", "bfloat16", "float16")  # worker.build.DTYPE_CHOICES (not imported: it needs torch)
# gateway.text.tool_syntax.TOOL_CALL_PARSERS (a test keeps them equal; not imported: it costs every command 0.2 s)
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json")
# worker.paths.base.DENSE_WEIGHT_MODES (a test keeps them equal; not imported: worker.paths.base needs torch)
DENSE_WEIGHT_MODES = ("auto", "on", "off")


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
NON_NEGATIVE_INT = _ranged(int, 0, what=">= 0")
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
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="auto: bfloat16 on CUDA and on CPUs with avx512_bf16/AMX, else float32 (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="where the gateway listens (default: %(default)s)")
    parser.add_argument("--internal-host", default="127.0.0.1",
                        help="where the scheduler and worker listen (default: %(default)s); anything but "
                             "loopback needs mutual TLS (--tls-client-cert) or --insecure-internal")
    parser.add_argument("--insecure-internal", action="store_true",
                        help="let scheduler and worker listen on a non-loopback --internal-host without mutual TLS "
                             "(no caller authentication; each logs a warning)")
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
    parser.add_argument("--kv-cache-mb", type=POSITIVE,
                        help="KV cache memory; overrides --kv-cache-memory-fraction (default: sized from free memory)")
    parser.add_argument("--kv-cache-memory-fraction", type=float,
                        help="share of the memory free after the weights and a profile pass that the KV cache takes "
                             "(default: 0.9 on CUDA, 0.1 of available RAM on CPU)")
    parser.add_argument("--swap-space-gb", type=float, default=0.0,
                        help="host memory for swapped-out KV pages (pinned on CUDA); preemption swaps or recomputes "
                             "by cost (default: 0, recompute only)")
    parser.add_argument("--num-blocks", type=POSITIVE, help="KV pages; overrides --kv-cache-mb")
    parser.add_argument("--max-num-seqs", type=POSITIVE, default=64, help="batch size limit (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=POSITIVE, default=512,
                        help="token budget per step (default: %(default)s)")
    parser.add_argument("--max-model-len", type=POSITIVE, help="context limit (default: the model's)")
    parser.add_argument("--target-itl-ms", type=float,
                        help="inter-token latency target: step budgets and batch size tuned online to meet it")
    parser.add_argument("--target-ttft-ms", type=float, help="time-to-first-token target")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="the scheduler plans step N+1 while the worker runs step N")
    parser.add_argument("--no-delta-stream", action="store_true",
                        help="the gateway gets each request's tokens on its own Submit call instead of one "
                             "StreamDeltas call carrying a step's tokens for all of them")
    # the worker's execution; the same names and choices as worker.paths.base (not imported: it needs torch)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="worker device; auto: cuda when torch sees a GPU (default: %(default)s)")
    parser.add_argument("--kernel-backend", choices=("auto", "torch", "triton"), default="auto",
                        help="auto: triton on CUDA, torch on CPU (default: %(default)s)")
    parser.add_argument("--quantization", choices=("auto", "none", "int8", "int4"), default="auto",
                        help="auto: a GGUF file's weights as it holds them (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K), a folder's "
                             "in --dtype; none: all in --dtype (the reference); int8 / int4: weight-only, quantized "
                             "at load (default: %(default)s)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="decode steps run eagerly (CUDA only)")
    parser.add_argument("--no-stream-overlap", action="store_true", help="no pinned staging / copy stream (CUDA only)")
    parser.add_argument("--cpu-int8-activations", action="store_true",
                        help="CPU: up to 16 rows against group-quantized weights (4-bit, Q8_0, K-quants) round "
                             "their activations to int8 per block of 32 (llama.cpp's way; faster, slightly less "
                             "exact: see tokenmill accuracy)")
    parser.add_argument("--no-packed-linears", action="store_true",
                        help="plain nn.Linear instead of oneDNN-reordered weights (CPU, float32 only)")
    parser.add_argument("--no-cpu-fused-ops", action="store_true",
                        help="the decoder's norms, SwiGLU, RoPE and decode attention in plain torch (the reference) "
                             "instead of compiled ops reading the KV pages in place (CPU)")
    parser.add_argument("--cpu-dense-weights", choices=DENSE_WEIGHT_MODES, default="auto",
                        help="CPU: group-quantized linears also keep their weight dequantized for oneDNN, for steps "
                             "of 5 rows or more (batched decode, prefill): one GEMM a linear, AMX where there is "
                             "one, for 2 bytes a weight; auto: bfloat16 models on a CPU with native bfloat16, within "
                             "a quarter of available memory (default: %(default)s)")
    parser.add_argument("--deterministic", "--batch-invariant", action="store_true",
                        help="batch-invariant kernels: greedy output the same alone or batched, after preemption "
                             "and after a worker restart (CPU torch path only; slower: docs/reliability.md)")
    parser.add_argument("--max-waiting-requests", type=POSITIVE, default=4096,
                        help="queued requests beyond which the scheduler answers RESOURCE_EXHAUSTED (default: %(default)s)")
    parser.add_argument("--max-waiting-tokens", type=NON_NEGATIVE_INT, default=0,
                        help="queued prompt tokens beyond which it does; 0: no bound (default: %(default)s)")
    parser.add_argument("--api-keys-file", help="the gateway's API keys, JSON lines from `tokenmill hash-api-key`; "
                                                "unset: authentication off")
    parser.add_argument("--rate-limit-rps", type=NON_NEGATIVE_FLOAT, default=0.0,
                        help="requests/s per API key unless its line says; 0: no limit (default: %(default)s)")
    parser.add_argument("--rate-limit-burst", type=NON_NEGATIVE_INT, default=0,
                        help="requests a key may send at once (default: the rate, rounded up)")
    parser.add_argument("--no-metrics", action="store_true", help="no Prometheus /metrics endpoints")
    parser.add_argument("--gateway-metrics-port", type=PORT, default=9400,
                        help="Prometheus /metrics of the gateway; 0 picks a free port (default: %(default)s)")
    parser.add_argument("--scheduler-metrics-port", type=PORT, default=9401, help="(default: %(default)s)")
    parser.add_argument("--worker-metrics-port", type=PORT, default=9402, help="(default: %(default)s)")
    parser.add_argument("--supervisor-metrics-port", type=PORT, default=9403,
                        help="this process's own /metrics: each child up, its restarts, and whether it is "
                             "crash-looping (default: %(default)s)")
    parser.add_argument("--startup-timeout-s", type=_ranged(float, 0.0, low_open=True, what="> 0"), default=300.0,
                        help="how long each component may take to become ready (default: %(default)s)")
    parser.add_argument("--grace-period-s", type=NON_NEGATIVE_FLOAT, default=10.0,
                        help="per component, between SIGTERM and SIGKILL at shutdown (default: %(default)s)")
    parser.add_argument("--drain-timeout-s", "--drain-timeout", type=NON_NEGATIVE_FLOAT, default=30.0,
                        help="at shutdown, how long gateway and scheduler let in-flight requests finish; "
                             "the grace period is stretched to cover it (default: %(default)s)")
    parser.add_argument("--no-retry-on-worker-failure", action="store_true",
                        help="a crashed worker's requests fail (UNAVAILABLE) instead of being recomputed")
    parser.add_argument("--stream-idle-timeout-s", type=NON_NEGATIVE_FLOAT, default=120.0,
                        help="a stream whose client has read nothing for this long is cancelled, its pages "
                             "freed and its record failed with the reason; 0 disables (default: %(default)s)")
    parser.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                        help="how the model writes tool calls (OpenAI chat tools): hermes (<tool_call> JSON: "
                             "Qwen2.5, Hermes) or llama3_json (Llama 3.1+); auto reads the chat template")
    parser.add_argument("--http-header-timeout-s", type=NON_NEGATIVE_FLOAT, default=10.0,
                        help="an HTTP client that has not sent a request's complete headers this long after their "
                             "first byte is disconnected; 0: no limit (default: %(default)s)")
    parser.add_argument("--http-keepalive-timeout-s", type=_ranged(float, 0.0, low_open=True, what="> 0"),
                        default=30.0, help="an idle HTTP connection is closed after this long (default: %(default)s)")
    parser.add_argument("--http-max-connections-per-client", type=NON_NEGATIVE_INT, default=256,
                        help="open HTTP connections per client address; more are answered 429 and closed; "
                             "0: no cap (default: %(default)s)")
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
    parser.add_argument("--requests-per-s", type=_ranged(float, 0.0, low_open=True, what="> 0"),
                        help="this key's rate limit (default: the gateway's --rate-limit-rps)")
    parser.add_argument("--burst", type=POSITIVE, help="this key's burst (default: the gateway's)")
    parser.add_argument("--target-itl-ms", type=_ranged(float, 0.0, low_open=True, what="> 0"),
                        help="this key's inter-token latency target, its class of service (default: the "
                             "scheduler's --target-itl-ms)")
    parser.add_argument("--target-ttft-ms", type=_ranged(float, 0.0, low_open=True, what="> 0"),
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
    from kvstore.credentials import redact_url
    from tokenmill.cluster.config import ClusterConfig, resolve_ports
    from tokenmill.cluster.specs import cluster_specs, restart_policies
    from tokenmill.cluster.readiness import port_in_use
    from tokenmill.cluster.supervisor import PortInUse, Supervisor, SupervisorError, run_until_stopped

    if args.model is not None and not os.path.exists(args.model):
        print(f"error: --model {args.model}: no such file or directory", file=sys.stderr)
        return 2
    try:
        security = serve_security_options(args)
    except ValueError as error:  # TLSConfigError too
        print(f"error: {error}", file=sys.stderr)
        return 2
    config = resolve_ports(ClusterConfig(
        **security, model=args.model, dtype=args.dtype, host=args.host, internal_host=args.internal_host,
        insecure_internal=args.insecure_internal,
        gateway_port=args.gateway_port,
        http_port=None if args.no_http else args.http_port,
        scheduler_port=args.scheduler_port, worker_port=args.worker_port, redis_url=args.redis_url,
        redis_port=args.redis_port, kv_policy=args.kv_policy, queue_policy=args.queue_policy,
        block_size=args.block_size, kv_cache_mb=args.kv_cache_mb, num_blocks=args.num_blocks,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction, swap_space_gb=args.swap_space_gb,
        target_itl_ms=args.target_itl_ms, target_ttft_ms=args.target_ttft_ms,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
        async_scheduling=args.async_scheduling, delta_stream=not args.no_delta_stream, device=args.device, kernel_backend=args.kernel_backend, quantization=args.quantization,
        cuda_graphs=not args.no_cuda_graphs, stream_overlap=not args.no_stream_overlap,
        packed_linears=not args.no_packed_linears, cpu_int8_activations=args.cpu_int8_activations,
        cpu_fused_ops=not args.no_cpu_fused_ops, cpu_dense_weights=args.cpu_dense_weights,
        deterministic=args.deterministic,
        max_waiting_requests=args.max_waiting_requests, max_waiting_tokens=args.max_waiting_tokens,
        api_keys_file=args.api_keys_file, rate_limit_rps=args.rate_limit_rps,
        rate_limit_burst=args.rate_limit_burst,
        drain_timeout_s=args.drain_timeout_s, retry_on_worker_failure=not args.no_retry_on_worker_failure,
        stream_idle_timeout_s=args.stream_idle_timeout_s, tool_call_parser=args.tool_call_parser,
        http_header_timeout_s=args.http_header_timeout_s, http_keepalive_timeout_s=args.http_keepalive_timeout_s,
        http_max_connections_per_client=args.http_max_connections_per_client,
        **({} if args.no_metrics else {"gateway_metrics_port": args.gateway_metrics_port,
                                       "scheduler_metrics_port": args.scheduler_metrics_port,
                                       "worker_metrics_port": args.worker_metrics_port})))
    try:
        specs = cluster_specs(config)
    except (FileNotFoundError, ValueError) as error:  # no redis-server binary; a password redis.conf cannot hold
        print(f"error: {error}", file=sys.stderr)
        return 2
    # crashed worker/scheduler/gateway (and our own redis-server) are restarted with backoff; the
    # grace period covers the drain
    supervisor = Supervisor(specs, startup_timeout_s=args.startup_timeout_s,
                            grace_s=max(args.grace_period_s, args.drain_timeout_s + 5.0),
                            restart_policies=restart_policies(redis=config.redis_url is None))
    try:
        supervisor.check_ports()
        if config.http_port is not None and port_in_use(f"{config.host}:{config.http_port}"):
            raise PortInUse("gateway HTTP", f"{config.host}:{config.http_port}", "--http-port (or --no-http)")
        for name in ("gateway", "scheduler", "worker"):
            port = getattr(config, f"{name}_metrics_port")
            if port is not None and port_in_use(f"{config.host}:{port}"):
                raise PortInUse(f"{name} metrics", f"{config.host}:{port}", f"--{name}-metrics-port (or --no-metrics)")
        supervisor_metrics_port = None if args.no_metrics else args.supervisor_metrics_port
        if supervisor_metrics_port and port_in_use(f"{config.host}:{supervisor_metrics_port}"):
            raise PortInUse("supervisor metrics", f"{config.host}:{supervisor_metrics_port}",
                            "--supervisor-metrics-port (or --no-metrics)")
    except SupervisorError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1

    def on_ready() -> None:
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

    metrics_server = None
    if supervisor_metrics_port is not None:
        from tokenmill.cluster.supervisor_metrics import serve_supervisor_metrics

        metrics_server = serve_supervisor_metrics(supervisor, config.host, supervisor_metrics_port)
    try:
        return run_until_stopped(supervisor, on_ready)
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()


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
