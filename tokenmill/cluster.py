"""A whole local cluster as child specs: redis-server, worker, scheduler, gateway, in start order.

    config = resolve_ports(ClusterConfig(model="tiny.gguf", gateway_port=0, scheduler_port=0,
                                         worker_port=0, redis_port=0))   # 0: a free port
    with Supervisor(cluster_specs(config)) as cluster:
        channel = grpc.insecure_channel(config.gateway_address)
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from tokenmill.child_process import ChildSpec
from tokenmill.readiness import connect_address, free_port
from tokenmill.redis_process import redis_spec, redis_url
from tokenmill.rpc import GENERATION_SERVICE, SCHEDULER_SERVICE, WORKER_SERVICE

# The checkout (or site-packages) holding the worker/scheduler/gateway packages, put on the children's
# PYTHONPATH so `python -m worker.main` works whatever directory `tokenmill serve` runs in.
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    model: str | None = None  # GGUF file or HF folder; None: the default SmolLM2-135M-Instruct GGUF
    dtype: str = "float32"
    host: str = "127.0.0.1"  # where the three gRPC servers listen
    gateway_port: int = 50051  # 0: pick a free port (resolve_ports)
    # The gateway's OpenAI-compatible HTTP API; None: off (so test clusters never fight over one fixed
    # port; `tokenmill serve` passes 8000 unless told otherwise); 0: pick a free port.
    http_port: int | None = None
    scheduler_port: int = 50052
    worker_port: int = 50053
    redis_url: str | None = None  # an existing Redis; None: start redis-server on redis_port
    redis_port: int = 6379
    kv_policy: str = "paged"
    queue_policy: str = "fcfs"
    block_size: int = 16
    kv_cache_mb: int = 512
    num_blocks: int | None = None  # overrides kv_cache_mb
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
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
        return connect_address(f"{self.host}:{self.scheduler_port}")

    @property
    def worker_address(self) -> str:
        return connect_address(f"{self.host}:{self.worker_port}")

    @property
    def effective_redis_url(self) -> str:
        return self.redis_url or redis_url(self.redis_port)


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
    return replace(config,
                   worker_port=pick(config.worker_port, local_host),
                   scheduler_port=pick(config.scheduler_port, local_host),
                   gateway_port=pick(config.gateway_port, local_host),
                   http_port=None if config.http_port is None else pick(config.http_port, local_host),
                   **{name: None if getattr(config, name) is None else pick(getattr(config, name), local_host)
                      for name in _METRICS_PORTS},
                   redis_port=config.redis_port if config.redis_url else pick(config.redis_port, "127.0.0.1"))


def torch_thread_env() -> dict[str, str]:
    """OpenMP waits passively unless told otherwise.

    libgomp's default spin-wait collapses when the torch threads share cores with anything else (the
    scheduler and gateway beside the worker, other tenants): a 32-request decode step went from
    ~0.22 s to ~1.6-3 s with one busy process beside it; with PASSIVE it stayed at its fair share.
    """
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def cluster_specs(config: ClusterConfig) -> list[ChildSpec]:
    """Children in start order: [redis,] worker, scheduler, gateway. Ports must be resolved already."""
    ports = [config.worker_port, config.scheduler_port, config.gateway_port]
    if (0 in ports or config.http_port == 0 or (config.redis_url is None and config.redis_port == 0)
            or 0 in [getattr(config, name) for name in _METRICS_PORTS]):
        raise ValueError("cluster_specs needs concrete ports: call resolve_ports(config) first")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p),
           **torch_thread_env(), **dict(config.child_env)}
    model = ["--model", config.model] if config.model else []
    worker = [config.python, "-m", "worker.main", "--host", config.host, "--port", str(config.worker_port),
              *model, "--dtype", config.dtype, "--block-size", str(config.block_size),
              "--kv-cache-mb", str(config.kv_cache_mb)]
    if config.num_blocks is not None:
        worker += ["--num-blocks", str(config.num_blocks)]
    scheduler = [config.python, "-m", "scheduler.main", "--host", config.host, "--port", str(config.scheduler_port),
                 "--worker", config.worker_address, "--redis-url", config.effective_redis_url,
                 "--kv-policy", config.kv_policy, "--queue-policy", config.queue_policy,
                 "--max-num-seqs", str(config.max_num_seqs),
                 "--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    if config.max_model_len is not None:
        scheduler += ["--max-model-len", str(config.max_model_len)]
    if not config.enable_prefix_caching:
        scheduler.append("--no-prefix-caching")
    gateway = [config.python, "-m", "gateway.main", "--host", config.host, "--port", str(config.gateway_port),
               "--scheduler", config.scheduler_address, "--redis-url", config.effective_redis_url, *model,
               "--http-port", str(config.http_port or 0)]
    for argv, port in ((worker, config.worker_metrics_port), (scheduler, config.scheduler_metrics_port),
                       (gateway, config.gateway_metrics_port)):
        if port is not None:
            argv += ["--metrics-port", str(port)]
    specs = [] if config.redis_url else [redis_spec(config.redis_port)]
    return specs + [
        ChildSpec("worker", worker, WORKER_SERVICE, f"{config.host}:{config.worker_port}",
                  port_hint="--worker-port", env=env),
        ChildSpec("scheduler", scheduler, SCHEDULER_SERVICE, f"{config.host}:{config.scheduler_port}",
                  port_hint="--scheduler-port", env=env),
        ChildSpec("gateway", gateway, GENERATION_SERVICE, f"{config.host}:{config.gateway_port}",
                  port_hint="--gateway-port", env=env),
    ]
