"""The gateway process's options, declared once (STYLE.md habit 16): each field of GatewayOptions carries
its flag (plumbing.options). Cheap to import: no gRPC, no tokenizer, no torch, so `tokenmill serve` reads
the gateway's flags from here.

    parser = argparse.ArgumentParser()
    GatewayOptions.add_arguments(parser)      # the flags this service owns
    add_process_arguments(parser)             # --scheduler (repeated) and plumbing's shared flags
    options = GatewayOptions.from_args(args, scheduler=..., tls=..., scheduler_tls=..., http_connections=...,
                                       internal_secret=..., max_message_bytes=..., metrics_port=...)

The flags plumbing declares for every service (the TLS files, --internal-secret-file, --max-message-bytes,
--metrics-port) and the HTTP connection limits (gateway.apis.openai.http_connections, which checks them)
are not repeated here: their values land in plain fields through `from_args` overrides, the composites
among them already built and checked (gateway.main.parse_args). So does --scheduler: a flag given once per
replica, which a cluster sets for its gateway.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.text.tool_syntax_names import TOOL_CALL_PARSERS
from plumbing.message_size import PUBLIC_MAX_MESSAGE_BYTES
from plumbing.options import NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT, PORT, POSITIVE, Options, option

if TYPE_CHECKING:
    from gateway.apis.openai.http_connections import ConnectionLimits
    from plumbing.tls import ClientTLS, ServerTLS

DEFAULT_SCHEDULER = "127.0.0.1:50052"


@dataclass(frozen=True, slots=True)
class GatewayOptions(Options):
    GROUP = "gateway"

    # where it listens (a cluster sets these per child)
    host: str = option("127.0.0.1", "interface the gRPC server and the HTTP API listen on", cluster=False)
    port: int = option(50051, "gRPC port (tokenmill.v1 and KServe v2)", type=PORT, cluster=False)
    http_port: int = option(8000, "OpenAI-compatible HTTP API; 0 disables", type=PORT, cluster=False)
    # the schedulers behind it (gateway.upstream)
    scheduler_dns: str = option("", "HOST:PORT whose every address is a model replica (a Kubernetes headless "
                                    "Service), re-resolved every --scheduler-dns-refresh-s", cluster=False)
    scheduler_dns_refresh_s: float = option(10.0, "how often --scheduler-dns is resolved again", type=float,
                                            cluster=False)  # a local cluster names its scheduler
    replica_max_load_imbalance: float = option(
        4.0, "requests more than the least loaded replica a prefix-holding replica may have", type=float)
    scheduler_timeout_s: float = option(600.0, "how long to wait for the scheduler to be ready", type=float)
    delta_stream: bool = option(
        True, "each request's tokens come on its own Submit call instead of one StreamDeltas call per scheduler "
              "carrying a step's tokens for all of them (gateway.upstream.delta_stream)", flag="--no-delta-stream")
    redis_url: str = option("", "answers GetRequestStatus, redis://[USER:PASSWORD@]HOST:PORT/DB (default: "
                                "$TOKENMILL_REDIS_URL); empty: status unavailable", env="TOKENMILL_REDIS_URL",
                            cluster=False)
    # what a request may ask for (gateway.prepare.validation.Limits)
    model: str | None = option(None, "the model's GGUF file or HF folder (for its tokenizer)", cluster=False)
    max_tokens_limit: int = option(4096, "the most output tokens one request may ask for", type=int)
    default_max_tokens: int = option(256, "output tokens of a request that does not say", type=int)
    tool_call_parser: str = option(
        "auto", "how the model writes tool calls (OpenAI chat tools): hermes (<tool_call> JSON: Qwen2.5, Hermes) "
                "or llama3_json (Llama 3.1+); auto reads the chat template", choices=TOOL_CALL_PARSERS)
    # output constraints, compiled off the event loop (plumbing.grammar_sandbox)
    grammar_helpers: int = option(
        2, "helper processes that compile clients' output constraints (JSON schemas, regexes, grammars) off the "
           "event loop; a constraint that crashes or overruns one costs that helper only "
           "(plumbing.grammar_sandbox)", type=int)
    grammar_timeout_s: float = option(
        5.0, "a constraint whose compile takes longer is refused (400 naming the limit)", type=float)
    grammar_memory_mb: int = option(
        1024, "address-space cap of each grammar helper; a constraint needing more is refused", type=int)
    # who may call, how often (gateway.access)
    api_keys_file: str = option(
        "", "JSON lines {name, sha256, requests_per_s?, burst?, target_itl_ms?, target_ttft_ms?} (tokenmill "
            "hash-api-key); clients send 'authorization: Bearer KEY'. Empty: authentication off")
    rate_limit_rps: float = option(
        0.0, "requests/s per API key (per client when auth is off) unless its line says; 0: none",
        type=NON_NEGATIVE_FLOAT)
    rate_limit_burst: int = option(0, "requests a key may send at once (default: the rate, rounded up)",
                                   type=NON_NEGATIVE_INT)
    http_api_key: str = option("", "HTTP clients must send 'Authorization: Bearer KEY'",
                                cluster=False)  # never through a child's argv, where `ps` shows it: --api-keys-file
    # streams and connections
    stream_idle_timeout_s: float = option(
        120.0, "a streaming call (GenerateStream, KServe ModelStreamInfer, HTTP stream=true) whose client has read "
               "nothing for this long (its messages back up under flow control) is cancelled (gRPC CANCELLED; "
               "HTTP: the connection is reset), its pages freed and its record failed with the reason; 0 disables",
        type=NON_NEGATIVE_FLOAT)
    # A supervisor's or Kubernetes' restart of a killed scheduler, its worker's re-registration and its
    # re-admission of what it ran take seconds; a stream gives it this long (gateway.generation.resume)
    scheduler_resume_wait_s: float = option(
        30.0, "with Redis, a stream (every API) whose scheduler goes away mid-request waits this long for the "
              "restarted scheduler to go on with it (it re-admits the request) and continues from Redis without a "
              "lost or repeated token; 0: it ends UNAVAILABLE at once", type=float)
    stream_interval: int = option(1, "tokens per message after a stream's first (its last may carry fewer): fewer, "
                                     "larger messages cost less gateway CPU per token (vLLM's and SGLang's "
                                     "--stream-interval)", type=POSITIVE)
    max_connection_age_s: float = option(
        1800.0, "gRPC connections older than this get GOAWAY (calls in flight finish first), so clients behind a "
                "load balancer spread over new replicas; 0 disables", type=float)
    reflection: bool = option(True, "do not serve gRPC server reflection", flag="--no-reflection", cluster=False)
    # processes (gateway.processes)
    processes: int = option(
        0, "gateway processes sharing the gRPC and HTTP ports (SO_REUSEPORT), each a full gateway on its own core; "
           "process i serves /metrics on --metrics-port + i. 0: the cores the container's CPU quota gives "
           "(cgroup cpu.max, at most the CPU affinity; 1 without a quota); always 1 with --port 0", type=NON_NEGATIVE_INT)
    # shutdown
    drain_timeout_s: float = option(
        30.0, "on SIGTERM: readiness off, new requests UNAVAILABLE, in-flight ones get this long",
        flag=("--drain-timeout-s", "--drain-timeout"), type=float, cluster=False)
    metrics_linger_s: float = option(
        15.0, "when the drain timeout cut requests, /metrics stays up this long after the cut (one scrape "
              "interval), so their drained endings are scraped before the process exits; a drain that cut "
              "nothing exits at once; 0: never wait", type=float)
    # what add_process_arguments' flags set (filled through from_args overrides in gateway.main)
    scheduler: tuple[str, ...] = field(default=(DEFAULT_SCHEDULER,))  # one address per replica
    max_message_bytes: int = field(default=PUBLIC_MAX_MESSAGE_BYTES)
    metrics_port: int | None = field(default=None)
    tls: ServerTLS | None = field(default=None)  # the gRPC server's; the HTTP API serves HTTPS with it too
    scheduler_tls: ClientTLS | None = field(default=None)
    http_connections: ConnectionLimits | None = field(default=None)  # None: gateway.apis.openai's defaults
    internal_secret: str | None = field(default=None)  # sent with every call to the (one) scheduler
    reuse_port: bool = field(default=False)  # set by gateway.processes: this process shares its ports


def add_process_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `python -m gateway.main` takes beside GatewayOptions' own: --scheduler, given once per
    replica, and what plumbing and the HTTP API declare (imported here, not at the top: gRPC and aiohttp)."""
    from gateway.apis.openai import http_connections
    from plumbing import internal_secret, telemetry, tls
    from plumbing.message_size import add_message_size_argument

    parser.add_argument("--scheduler", action="append", default=None,
                        help=f"scheduler address HOST:PORT; repeat for several model replicas (default "
                             f"{DEFAULT_SCHEDULER})")
    http_connections.add_arguments(parser)  # --http-header-timeout-s, --http-keepalive-timeout-s, per-client cap
    add_message_size_argument(parser, PUBLIC_MAX_MESSAGE_BYTES)
    tls.add_server_arguments(parser)  # the HTTP API serves HTTPS with the same files
    tls.add_client_arguments(parser, "scheduler")
    internal_secret.add_arguments(parser, "sent with every call to the scheduler (one --scheduler only)")
    telemetry.add_metrics_argument(parser)
