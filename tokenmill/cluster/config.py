"""A whole local cluster described once: the ports, hosts and settings of redis-server, worker,
scheduler and gateway (ClusterConfig), and resolve_ports for the ports given as 0.

    config = resolve_ports(ClusterConfig(model="tiny.gguf", gateway_port=0, scheduler_port=0,
                                         worker_port=0, redis_port=0))   # 0: a free port
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

from plumbing.message_size import INTERNAL_MAX_MESSAGE_BYTES, PUBLIC_MAX_MESSAGE_BYTES
from plumbing.tls import ClusterTLS
from tokenmill.cluster.readiness import connect_address, free_port
from tokenmill.cluster.redis_process import redis_url


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    model: str | None = None  # GGUF file or HF folder; None: the default SmolLM2-135M-Instruct GGUF
    dtype: str = "float32"
    host: str = "127.0.0.1"  # where the gateway listens (gRPC and HTTP)
    # where the scheduler and worker listen; beyond loopback they need mutual TLS (they admit callers by
    # the role their certificate names, plumbing.peer_roles) or insecure_internal
    internal_host: str = "127.0.0.1"
    insecure_internal: bool = False  # --insecure-internal: non-loopback internal_host without mTLS (logged)
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
    tls: ClusterTLS | None = None  # None: plaintext gRPC on every link
    max_message_bytes: int = PUBLIC_MAX_MESSAGE_BYTES  # the gateway's (gRPC messages and HTTP bodies)
    internal_max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES  # scheduler and worker
    kv_policy: str = "paged"
    queue_policy: str = "fcfs"
    block_size: int = 16
    kv_cache_mb: int | None = None  # None: sized from free memory (kv_cache_memory_fraction)
    kv_cache_memory_fraction: float | None = None  # None: the worker's device default (worker.kv_sizing)
    num_blocks: int | None = None  # overrides kv_cache_mb
    swap_space_gb: float = 0.0  # host memory for swapped-out KV pages; 0: preemption only recomputes
    target_itl_ms: float | None = None  # latency targets (scheduler.step_time); None: fixed budgets
    target_ttft_ms: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    async_scheduling: bool = False  # the scheduler plans step N+1 while the worker runs step N
    # the worker's execution (worker.paths.base): device auto = cuda when visible; backend auto = triton on CUDA
    device: str = "auto"
    kernel_backend: str = "auto"
    quantization: str = "auto"  # worker.paths.base.QUANTIZATIONS
    cuda_graphs: bool = True
    stream_overlap: bool = True
    packed_linears: bool = True  # CPU float32 (worker.linears.packed)
    cpu_int8_activations: bool = False  # worker.paths.base.ExecutionOptions
    cpu_fused_ops: bool = True  # worker.paths.base.ExecutionOptions; False: the plain-torch reference
    cpu_dense_weights: str = "auto"  # worker.paths.base.ExecutionOptions (worker.linears.dense_weights)
    deterministic: bool = False  # worker.paths.base.ExecutionOptions: batch-invariant kernels (worker.paths.batch_invariant)
    max_waiting_requests: int = 4096  # beyond these the scheduler answers RESOURCE_EXHAUSTED at once
    max_waiting_tokens: int = 0  # prompt tokens waiting; 0: no bound
    api_keys_file: str | None = None  # the gateway's keys (gateway.access.api_keys); None: authentication off
    rate_limit_rps: float = 0.0  # per API key unless its line says; 0: none
    rate_limit_burst: int = 0
    # SIGTERM to the gateway or scheduler: how long in-flight requests may take to finish
    drain_timeout_s: float = 30.0
    # the gateway's /metrics stays up this long after a drain that cut requests, for a last scrape (the
    # deployments set one scrape interval); 0 here: a local `tokenmill serve` stops at once
    gateway_metrics_linger_s: float = 0.0
    # a lost worker's requests are re-queued and recomputed once it is back; False: they fail (UNAVAILABLE)
    retry_on_worker_failure: bool = True
    # a gateway stream whose client has read nothing for this long is cancelled (gateway.apis.stream_idle); 0: never
    stream_idle_timeout_s: float = 120.0
    tool_call_parser: str = "auto"  # the gateway's --tool-call-parser (gateway.text.tool_syntax)
    # tokens batched per step on one StreamDeltas call (gateway.upstream.delta_stream); False: each on its own Submit call
    delta_stream: bool = True
    # the HTTP API's connection limits (gateway.apis.openai.http_connections); the gateway's flags of the same names
    http_header_timeout_s: float = 10.0
    http_keepalive_timeout_s: float = 30.0
    http_max_connections_per_client: int = 256  # 0: no cap
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


METRICS_PORTS = ("gateway_metrics_port", "scheduler_metrics_port", "worker_metrics_port")


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
