"""A whole local cluster described once: each service's own options, and what the cluster sets for
every child itself (ports, hosts, Redis, TLS, and the values several services share).

    config = resolve_ports(ClusterConfig(model="tiny.gguf", gateway_port=0, scheduler_port=0, worker_port=0,
                                         redis_port=0, worker=WorkerOptions(dtype="float32", num_blocks=64)))

`tokenmill serve` builds one from its flags: ClusterConfig.add_arguments declares the cluster's own flags
and offers each service's under the same names (one argparse group each, from the service's options);
ClusterConfig.from_args reads them back. Adding a flag to a service's options adds it here too.

A service's fields marked cluster=False (where it listens, its peers, the values below that several
services take) are the cluster's to set: cluster_specs sets them on each child from the fields of this
class, whatever the service's options say.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field, fields, replace
from typing import Any

from gateway.apis.openai import http_connections
from gateway.options import GatewayOptions
from plumbing.message_size import INTERNAL_MAX_MESSAGE_BYTES, PUBLIC_MAX_MESSAGE_BYTES
from plumbing.options import NON_NEGATIVE_FLOAT, PORT, POSITIVE, POWER_OF_TWO
from plumbing.tls import ClusterTLS
from scheduler.options import SchedulerOptions
from scheduler.speculation import check_draft_model
from tokenmill.cluster.readiness import connect_address, free_port
from tokenmill.cluster.redis_process import redis_url
from worker.options import WorkerOptions

# A cluster built in code runs float32 weights unless told otherwise, so a test or a benchmark gets the same
# numbers on every CPU (`tokenmill serve --dtype` defaults to auto, as the worker does), and its gateway
# exits as soon as a drain ends (the deployments keep /metrics up one scrape interval). Its gateway is one
# process (a test scrapes one /metrics; `--processes N` puts process i's on the gateway's metrics port + i,
# which the next service's default metrics port would be).
LOCAL_WORKER = WorkerOptions(dtype="float32")
LOCAL_GATEWAY = GatewayOptions(metrics_linger_s=0.0, processes=1)
SERVICES = (("worker", WorkerOptions), ("scheduler", SchedulerOptions), ("gateway", GatewayOptions))


_HTTP_LIMITS = http_connections.ConnectionLimits()  # the gateway's defaults are serve's


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    # each service's own options; their cluster=False fields are set per child from the fields below
    worker: WorkerOptions = LOCAL_WORKER
    scheduler: SchedulerOptions = SchedulerOptions()
    gateway: GatewayOptions = LOCAL_GATEWAY
    # values several services take, held once: the model (worker, gateway's tokenizer), the page size and
    # the step budget (worker's profile pass, scheduler), the drain (scheduler, gateway), and whether
    # scheduler and worker may listen beyond loopback without mutual TLS (each logs it)
    model: str | None = None  # GGUF file or HF folder; None: the default SmolLM2-135M-Instruct GGUF
    block_size: int = 16
    max_num_batched_tokens: int = 512
    drain_timeout_s: float = 30.0  # SIGTERM to the gateway or scheduler: how long in-flight requests may take
    insecure_internal: bool = False
    # where each listens: the gateway on host, scheduler and worker on internal_host (beyond loopback they
    # need mutual TLS: they admit callers by the role their certificate names, plumbing.peer_roles)
    host: str = "127.0.0.1"
    internal_host: str = "127.0.0.1"
    gateway_port: int = 50051  # 0: pick a free port (resolve_ports)
    # The gateway's OpenAI-compatible HTTP API; None: off (so test clusters never fight over one fixed
    # port; `tokenmill serve` passes 8000 unless told otherwise); 0: pick a free port.
    http_port: int | None = None
    scheduler_port: int = 50052
    worker_port: int = 50053
    redis_url: str | None = None  # an existing Redis; None: start redis-server on redis_port
    redis_port: int = 6379
    # credentials of the redis-server started here (not of redis_url, which carries its own): a password
    # alone sets requirepass; with a user, that ACL user and no unauthenticated default user
    redis_user: str | None = None
    redis_password: str | None = None
    # the links
    tls: ClusterTLS | None = None  # None: plaintext gRPC on every link
    max_message_bytes: int = PUBLIC_MAX_MESSAGE_BYTES  # the gateway's (gRPC messages and HTTP bodies)
    internal_max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES  # scheduler and worker
    # the HTTP API's connection limits (gateway.apis.openai.http_connections: the gateway's flags of the same names)
    http_header_timeout_s: float = _HTTP_LIMITS.header_timeout_s
    http_keepalive_timeout_s: float = _HTTP_LIMITS.keepalive_timeout_s
    http_max_connections_per_client: int = _HTTP_LIMITS.max_connections_per_client  # 0: no cap
    # scheduler and worker refuse calls without it, the gateway and scheduler send it (plumbing.internal_secret);
    # it travels in the environment, never argv. `tokenmill serve` makes one per cluster; None: none
    internal_secret: str | None = field(default=None, repr=False)
    python: str = sys.executable
    # Prometheus /metrics of each process; None: off (so parallel test clusters never clash; `tokenmill
    # serve` passes 9400 / 9401 / 9402); 0: pick a free port (resolve_ports).
    gateway_metrics_port: int | None = None
    scheduler_metrics_port: int | None = None
    worker_metrics_port: int | None = None
    # extra environment for the three servers, e.g. (("OTEL_EXPORTER_OTLP_ENDPOINT", "http://..."),)
    child_env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        check_draft_model(self.scheduler.speculative, self.worker.draft_model)  # before any process starts

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """`tokenmill serve`'s cluster flags, then each service's flags under its own name, one group each."""
        _add_address_arguments(parser)
        _add_shared_arguments(parser)
        for name, options in SERVICES:
            options.add_arguments(parser.add_argument_group(f"{name} (python -m {name}.main's flags of the same "
                                                            "names)"), cluster=True)
        # today's `tokenmill serve` gateway: a local cluster stops at once after a drain
        parser.set_defaults(metrics_linger_s=LOCAL_GATEWAY.metrics_linger_s, processes=LOCAL_GATEWAY.processes)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> ClusterConfig:
        """The config add_arguments' flags describe; overrides: the composites the caller built (TLS, secret)."""
        services = {name: options.from_args(argparse.Namespace(**{
            item.name: getattr(args, item.name) for item, _ in options.flagged_fields(cluster=True)}))
            for name, options in SERVICES}
        metrics = {} if args.no_metrics else {name: getattr(args, name) for name in METRICS_PORTS}
        own = {item.name: getattr(args, item.name) for item in fields(cls) if item.name in CLUSTER_FLAGS}
        return cls(**services, **own, http_port=None if args.no_http else args.http_port, **metrics, **overrides)

    @property
    def gateway_address(self) -> str:
        return connect_address(f"{self.host}:{self.gateway_port}")

    @property
    def http_address(self) -> str:
        """The HTTP API's host:port ("" when off); its base URL is http://{http_address}/v1."""
        return connect_address(f"{self.host}:{self.http_port}") if self.http_port is not None else ""

    @property
    def scheduler_address(self) -> str:
        return connect_address(f"{self.internal_host}:{self.scheduler_port}")

    @property
    def worker_address(self) -> str:
        return connect_address(f"{self.internal_host}:{self.worker_port}")

    @property
    def effective_redis_url(self) -> str:
        """May hold a password: print kvstore.credentials.redact_url(...) of it."""
        return self.redis_url or redis_url(self.redis_port, self.redis_user, self.redis_password)


def with_settings(config: ClusterConfig, **settings: Any) -> ClusterConfig:
    """config with each setting where it lives: a ClusterConfig field of that name, else the one service's
    options that declare it (for benchmarks and tests that name their settings flat: a page budget, a
    latency target, swap space).

        with_settings(ClusterConfig(), num_blocks=64, kv_policy="static", max_num_batched_tokens=256)
        # worker.num_blocks, scheduler.kv_policy, and the cluster's own max_num_batched_tokens
    """
    own = {item.name for item in fields(config)}
    services: dict[str, dict[str, Any]] = {name: {} for name, _ in SERVICES}
    for name, value in settings.items():
        if name in own:
            continue
        owners = [service for service, options in SERVICES if name in {item.name for item in fields(options)}]
        if len(owners) != 1:
            raise ValueError(f"{name}: {'declared by ' + ' and '.join(owners) if owners else 'no such setting'}; "
                             "set it on that service's options")
        services[owners[0]][name] = value
    return replace(config, **{name: value for name, value in settings.items() if name in own},
                   **{name: replace(getattr(config, name), **values) for name, values in services.items() if values})


METRICS_PORTS = ("gateway_metrics_port", "scheduler_metrics_port", "worker_metrics_port")
# ClusterConfig fields read from flags of the same names (http_port and the metrics ports have switches too)
CLUSTER_FLAGS = ("model", "block_size", "max_num_batched_tokens", "drain_timeout_s", "insecure_internal", "host",
                 "internal_host", "gateway_port", "scheduler_port", "worker_port", "redis_url", "redis_port",
                 "http_header_timeout_s", "http_keepalive_timeout_s", "http_max_connections_per_client")



def _add_address_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF file or Hugging Face folder (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--host", default="127.0.0.1", help="where the gateway listens (default: %(default)s)")
    parser.add_argument("--internal-host", default="127.0.0.1",
                        help="where the scheduler and worker listen (default: %(default)s); anything but "
                             "loopback needs mutual TLS (--tls-client-cert) or --insecure-internal")
    parser.add_argument("--insecure-internal", action="store_true",
                        help="let scheduler and worker listen on a non-loopback --internal-host without mutual TLS "
                             "(no caller authentication; each logs a warning)")
    parser.add_argument("--gateway-port", type=PORT, default=50051,
                        help="public API; 0 picks a free port (default: %(default)s)")
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
    parser.add_argument("--no-metrics", action="store_true", help="no Prometheus /metrics endpoints")
    parser.add_argument("--gateway-metrics-port", type=PORT, default=9400,
                        help="Prometheus /metrics of the gateway; 0 picks a free port (default: %(default)s)")
    parser.add_argument("--scheduler-metrics-port", type=PORT, default=9401, help="(default: %(default)s)")
    parser.add_argument("--worker-metrics-port", type=PORT, default=9402, help="(default: %(default)s)")


def _add_shared_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=POWER_OF_TWO, default=16, help="tokens per KV page (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=POSITIVE, default=512,
                        help="token budget per step (default: %(default)s)")
    parser.add_argument("--drain-timeout-s", "--drain-timeout", type=NON_NEGATIVE_FLOAT, default=30.0,
                        help="at shutdown, how long gateway and scheduler let in-flight requests finish; "
                             "the grace period is stretched to cover it (default: %(default)s)")
    http_connections.add_arguments(parser)  # the gateway's own flags, passed on to it


def resolve_ports(config: ClusterConfig) -> ClusterConfig:
    """The same config with every port given as 0 replaced by a currently free one."""
    # free ports are drawn so as not to clash with ports given explicitly (kept as given: a clash
    # between two explicit ports is the supervisor's check_ports to report)
    taken = {port for port in (config.worker_port, config.scheduler_port, config.gateway_port,
                               config.http_port, config.redis_port, config.gateway_metrics_port,
                               config.scheduler_metrics_port, config.worker_metrics_port) if port}

    def pick(port: int, host: str) -> int:
        while port == 0:
            candidate = free_port(host)
            port = 0 if candidate in taken else candidate
        taken.add(port)
        return port

    local_host = "127.0.0.1" if config.host in ("", "0.0.0.0") else config.host
    internal_host = "127.0.0.1" if config.internal_host in ("", "0.0.0.0") else config.internal_host
    return replace(config,
                   worker_port=pick(config.worker_port, internal_host),
                   scheduler_port=pick(config.scheduler_port, internal_host),
                   gateway_port=pick(config.gateway_port, local_host),
                   http_port=None if config.http_port is None else pick(config.http_port, local_host),
                   **{name: None if getattr(config, name) is None else pick(getattr(config, name), local_host)
                      for name in METRICS_PORTS},
                   redis_port=config.redis_port if config.redis_url else pick(config.redis_port, "127.0.0.1"))
