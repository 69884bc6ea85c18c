"""A whole local cluster as child specs: redis-server, worker, scheduler, gateway, in start order.

    config = resolve_ports(ClusterConfig(model="tiny.gguf", gateway_port=0, scheduler_port=0,
                                         worker_port=0, redis_port=0))   # 0: a free port
    with Supervisor(cluster_specs(config)) as cluster:
        channel = grpc.insecure_channel(config.gateway_address)
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from tokenmill.child_process import ChildSpec
from plumbing.message_size import INTERNAL_MAX_MESSAGE_BYTES, PUBLIC_MAX_MESSAGE_BYTES
from tokenmill.readiness import connect_address, free_port
from tokenmill.redis_process import redis_spec, redis_url
from tokenmill.restart_policy import RestartPolicy
from plumbing.rpc import GENERATION_SERVICE, SCHEDULER_SERVICE, WORKER_SERVICE
from plumbing.tls import ClusterTLS

# The checkout (or site-packages) holding the worker/scheduler/gateway packages, put on the children's
# PYTHONPATH so `python -m worker.main` works whatever directory `tokenmill serve` runs in.
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


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
    # the worker's execution (worker.backends): device auto = cuda when visible; backend auto = triton on CUDA
    device: str = "auto"
    kernel_backend: str = "auto"
    quantization: str = "auto"  # worker.backends.QUANTIZATIONS
    cuda_graphs: bool = True
    stream_overlap: bool = True
    packed_linears: bool = True  # CPU float32 (worker.cpu_linear)
    cpu_int8_activations: bool = False  # worker.backends.ExecutionOptions
    cpu_fused_ops: bool = True  # worker.backends.ExecutionOptions; False: the plain-torch reference
    cpu_dense_weights: str = "auto"  # worker.backends.ExecutionOptions (worker.dense_weights)
    deterministic: bool = False  # worker.backends.ExecutionOptions: batch-invariant kernels (worker.batch_invariant)
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


_METRICS_PORTS = ("gateway_metrics_port", "scheduler_metrics_port", "worker_metrics_port")


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
                      for name in _METRICS_PORTS},
                   redis_port=config.redis_port if config.redis_url else pick(config.redis_port, "127.0.0.1"))


# How long an idle OpenMP thread spins before it sleeps: libgomp loop iterations, well under a millisecond
SPIN_COUNT = "30000"


def torch_thread_env() -> dict[str, str]:
    """OpenMP threads spin briefly between parallel regions, then sleep (GOMP_SPINCOUNT), unless the
    environment already says how they wait (OMP_WAIT_POLICY or GOMP_SPINCOUNT: passed through as set).

    A decode step is ~180 parallel regions tens of microseconds apart; sleeping in between (PASSIVE)
    pays a wake-up in each. The served default model on 2 cores, one run after the other: one client
    28.1 tok/s PASSIVE against 48.9 spinning, 8 clients 107.8 against 147.2 (docs/benchmarks.md, "OpenMP
    waiting policy"). Spinning collapses where another process holds a core the worker's threads need
    (beside a CPU hog, without the governor: 2.6 tok/s): the worker then drops to one thread
    (worker/thread_governor.py; beside the hog 31.2 / 69.0 tok/s, PASSIVE 30.1 / 84.9).
    """
    if os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT"):
        return {}
    return {"GOMP_SPINCOUNT": SPIN_COUNT}


# The worker's KV sizing record, in its temp dir (worker --kv-sizing-record)
KV_SIZING_RECORD = "kv-sizing.json"


def _absolute_tls(tls: ClusterTLS) -> ClusterTLS:
    paths = {field.name: getattr(tls, field.name) for field in fields(tls)}
    return replace(tls, **{name: os.path.abspath(path) for name, path in paths.items() if path})


def cluster_specs(config: ClusterConfig) -> list[ChildSpec]:
    """Children in start order: [redis,] worker, scheduler, gateway. Ports must be resolved already."""
    ports = [config.worker_port, config.scheduler_port, config.gateway_port]
    if (0 in ports or config.http_port == 0 or (config.redis_url is None and config.redis_port == 0)
            or 0 in [getattr(config, name) for name in _METRICS_PORTS]):
        raise ValueError("cluster_specs needs concrete ports: call resolve_ports(config) first")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p),
           # the mains read it as their --redis-url default: a password in argv is in every `ps` listing
           "TOKENMILL_REDIS_URL": config.effective_redis_url,
           # set even when empty: none of ours reaches the children from the supervisor's own environment
           "TOKENMILL_INTERNAL_SECRET": config.internal_secret or "",
           **torch_thread_env(), **dict(config.child_env)}
    model = ["--model", config.model] if config.model else []
    server_tls = config.tls.server().argv() if config.tls else []
    probe_tls = config.tls.client() if config.tls else None
    internal_size = ["--max-message-bytes", str(config.internal_max_message_bytes)]
    # Sized from memory, the worker records its page count in its temp dir (its cwd, kept across crash
    # restarts), so a restart keeps the count the scheduler knows (worker.kv_sizing); paths it is given
    # are made absolute, since it no longer runs where they were named.
    records_sizing = config.num_blocks is None and config.kv_cache_mb is None
    worker_model = ["--model", os.path.abspath(config.model)] if config.model and records_sizing else model
    worker_tls = _absolute_tls(config.tls).server().argv() if config.tls and records_sizing else server_tls
    worker = [config.python, "-m", "worker.main", "--host", config.internal_host, "--port", str(config.worker_port),
              *worker_model, "--dtype", config.dtype, "--block-size", str(config.block_size),
              "--max-num-batched-tokens", str(config.max_num_batched_tokens), "--swap-space-gb", str(config.swap_space_gb),
              *worker_tls, *internal_size, *(["--kv-sizing-record", KV_SIZING_RECORD] if records_sizing else [])]
    if config.kv_cache_mb is not None:
        worker += ["--kv-cache-mb", str(config.kv_cache_mb)]
    if config.kv_cache_memory_fraction is not None:
        worker += ["--kv-cache-memory-fraction", str(config.kv_cache_memory_fraction)]
    if config.num_blocks is not None:
        worker += ["--num-blocks", str(config.num_blocks)]
    worker += ["--device", config.device, "--kernel-backend", config.kernel_backend, "--quantization", config.quantization]
    if not config.cuda_graphs:
        worker.append("--no-cuda-graphs")
    if not config.stream_overlap:
        worker.append("--no-stream-overlap")
    if not config.packed_linears:
        worker.append("--no-packed-linears")
    if config.cpu_int8_activations:
        worker.append("--cpu-int8-activations")
    if not config.cpu_fused_ops:
        worker.append("--no-cpu-fused-ops")
    worker += ["--cpu-dense-weights", config.cpu_dense_weights]
    if config.deterministic:
        worker.append("--deterministic")
    scheduler = [config.python, "-m", "scheduler.main", "--host", config.internal_host,
                 "--port", str(config.scheduler_port), "--worker", config.worker_address,
                 *server_tls, *(probe_tls.argv("worker") if probe_tls else []), *internal_size,
                 "--kv-policy", config.kv_policy, "--queue-policy", config.queue_policy,
                 "--max-num-seqs", str(config.max_num_seqs),
                 "--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    if config.max_model_len is not None:
        scheduler += ["--max-model-len", str(config.max_model_len)]
    for flag, value in (("--target-itl-ms", config.target_itl_ms), ("--target-ttft-ms", config.target_ttft_ms)):
        if value is not None:
            scheduler += [flag, str(value)]
    if not config.enable_prefix_caching:
        scheduler.append("--no-prefix-caching")
    if config.async_scheduling:
        scheduler.append("--async-scheduling")
    scheduler += ["--max-waiting-requests", str(config.max_waiting_requests),
                  "--max-waiting-tokens", str(config.max_waiting_tokens),
                  "--drain-timeout-s", str(config.drain_timeout_s)]
    if not config.retry_on_worker_failure:
        scheduler.append("--no-retry-on-worker-failure")
    if config.insecure_internal:
        worker.append("--insecure-internal")
        scheduler.append("--insecure-internal")
    gateway = [config.python, "-m", "gateway.main", "--host", config.host, "--port", str(config.gateway_port),
               "--scheduler", config.scheduler_address, *model, "--http-port", str(config.http_port or 0),
               "--drain-timeout-s", str(config.drain_timeout_s),
               "--metrics-linger-s", str(config.gateway_metrics_linger_s),
               "--stream-idle-timeout-s", str(config.stream_idle_timeout_s),
               "--tool-call-parser", config.tool_call_parser,
               *server_tls, *(probe_tls.argv("scheduler") if probe_tls else []),
               "--max-message-bytes", str(config.max_message_bytes),
               "--http-header-timeout-s", str(config.http_header_timeout_s),
               "--http-keepalive-timeout-s", str(config.http_keepalive_timeout_s),
               "--http-max-connections-per-client", str(config.http_max_connections_per_client),
               "--rate-limit-rps", str(config.rate_limit_rps), "--rate-limit-burst", str(config.rate_limit_burst)]
    if config.api_keys_file:
        gateway += ["--api-keys-file", config.api_keys_file]
    if not config.delta_stream:
        gateway.append("--no-delta-stream")
    for argv, port in ((worker, config.worker_metrics_port), (scheduler, config.scheduler_metrics_port),
                       (gateway, config.gateway_metrics_port)):
        if port is not None:
            argv += ["--metrics-port", str(port)]
    specs = [] if config.redis_url else [redis_spec(config.redis_port, user=config.redis_user,
                                                    password=config.redis_password)]
    worker_env = {name: value for name, value in env.items() if name != "TOKENMILL_REDIS_URL"}  # no Redis there
    return specs + [
        ChildSpec("worker", worker, WORKER_SERVICE, f"{config.internal_host}:{config.worker_port}",
                  port_hint="--worker-port", env=worker_env, tls=probe_tls, use_temp_dir=records_sizing),
        ChildSpec("scheduler", scheduler, SCHEDULER_SERVICE, f"{config.internal_host}:{config.scheduler_port}",
                  port_hint="--scheduler-port", env=env, tls=probe_tls),
        ChildSpec("gateway", gateway, GENERATION_SERVICE, f"{config.host}:{config.gateway_port}",
                  port_hint="--gateway-port", env=env, tls=probe_tls),
    ]


def restart_policies(policy: RestartPolicy | None = None, *, redis: bool = True) -> dict[str, RestartPolicy]:
    """Worker, scheduler and gateway are started again when they crash (the scheduler re-registers a
    restarted worker, gateways reconnect to a restarted scheduler), and so is the redis-server the
    cluster started (redis=True; pass False with ClusterConfig.redis_url: one started by somebody else
    is not ours to restart): its append-only file brings the records back, and the scheduler's
    writers replay what they kept in memory meanwhile (kvstore.state_writer, kvstore.token_streams)."""
    policy = policy or RestartPolicy()
    return {name: policy for name in ("worker", "scheduler", "gateway", *(("redis",) if redis else ()))}
