"""A whole local cluster as child specs: redis-server, worker, scheduler, gateway, in start order.

    config = resolve_ports(ClusterConfig(model="tiny.gguf", gateway_port=0, scheduler_port=0,
                                         worker_port=0, redis_port=0))   # 0: a free port
    with Supervisor(cluster_specs(config)) as cluster:
        channel = grpc.insecure_channel(config.gateway_address)
"""
from __future__ import annotations

import os
from dataclasses import fields, replace
from pathlib import Path

from gateway.options import GatewayOptions
from plumbing.rpc import GENERATION_SERVICE, SCHEDULER_SERVICE, WORKER_SERVICE
from plumbing.tls import ClusterTLS
from scheduler.options import SchedulerOptions
from tokenmill.cluster.child_process import ChildSpec
from tokenmill.cluster.config import METRICS_PORTS, ClusterConfig
from tokenmill.cluster.redis_process import redis_spec
from tokenmill.cluster.restart_policy import RestartPolicy
from worker.host_heap import heap_environment
from worker.options import WorkerOptions

# The checkout (or site-packages) holding the worker/scheduler/gateway packages, put on the children's
# PYTHONPATH so `python -m worker.main` works whatever directory `tokenmill serve` runs in.
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


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
    (worker/paths/thread_governor.py; beside the hog 31.2 / 69.0 tok/s, PASSIVE 30.1 / 84.9).
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
    """Children in start order: [redis,] worker, scheduler, gateway. Ports must be resolved already.

    Each server's command line is `python -m <service>.main` and its options' own flags (to_argv), after
    the cluster has set the fields it owns on them (worker_options, scheduler_options, gateway_options),
    plus the flags plumbing declares for every service (_plumbing_flags)."""
    ports = [config.worker_port, config.scheduler_port, config.gateway_port]
    if (0 in ports or config.http_port == 0 or (config.redis_url is None and config.redis_port == 0)
            or 0 in [getattr(config, name) for name in METRICS_PORTS]):
        raise ValueError("cluster_specs needs concrete ports: call resolve_ports(config) first")
    env = {"PYTHONPATH": os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p),
           # the mains read it as their --redis-url default: a password in argv is in every `ps` listing
           "TOKENMILL_REDIS_URL": config.effective_redis_url,
           # set even when empty: none of ours reaches the children from the supervisor's own environment
           "TOKENMILL_INTERNAL_SECRET": config.internal_secret or "",
           **torch_thread_env(), **dict(config.child_env)}
    probe_tls = config.tls.client() if config.tls else None
    worker, scheduler, gateway = worker_options(config), scheduler_options(config), gateway_options(config)
    http_limits = [arg for name in HTTP_LIMITS for arg in (f"--{name.replace('_', '-')}", str(getattr(config, name)))]
    specs = [] if config.redis_url else [redis_spec(config.redis_port, user=config.redis_user,
                                                    password=config.redis_password)]
    worker_env = {name: value for name, value in env.items() if name != "TOKENMILL_REDIS_URL"}  # no Redis there
    if worker.keep_freed_memory:
        worker_env.update(heap_environment({**os.environ, **worker_env}))  # read by glibc at start (worker.host_heap)
    return specs + [
        ChildSpec("worker", _argv(config, "worker.main", worker), WORKER_SERVICE,
                  f"{config.internal_host}:{config.worker_port}", port_hint="--worker-port", env=worker_env,
                  tls=probe_tls, use_temp_dir=worker.kv_sizing_record is not None),
        ChildSpec("scheduler", _argv(config, "scheduler.main", scheduler), SCHEDULER_SERVICE,
                  f"{config.internal_host}:{config.scheduler_port}", port_hint="--scheduler-port", env=env,
                  tls=probe_tls),
        ChildSpec("gateway", [*_argv(config, "gateway.main", gateway), *http_limits], GENERATION_SERVICE,
                  f"{config.host}:{config.gateway_port}", port_hint="--gateway-port", env=env, tls=probe_tls),
    ]


# the gateway's HTTP connection limits, flags of the same names (gateway.apis.openai.http_connections)
HTTP_LIMITS = ("http_header_timeout_s", "http_keepalive_timeout_s", "http_max_connections_per_client")


def worker_options(config: ClusterConfig) -> WorkerOptions:
    """The worker's options with what the cluster sets. Sized from memory, the worker records its page count
    in its temp dir (its cwd, kept across crash restarts), so a restart keeps the count the scheduler knows
    (worker.kv_sizing); paths it is given are made absolute, since it no longer runs where they were named."""
    records_sizing = config.worker.num_blocks is None and config.worker.kv_cache_mb is None
    tls = (_absolute_tls(config.tls) if records_sizing else config.tls).server() if config.tls else None
    return replace(config.worker, host=config.internal_host, port=config.worker_port,
                   model=os.path.abspath(config.model) if config.model and records_sizing else config.model,
                   block_size=config.block_size, max_num_batched_tokens=config.max_num_batched_tokens,
                   kv_sizing_record=Path(KV_SIZING_RECORD) if records_sizing else None, tls=tls,
                   max_message_bytes=config.internal_max_message_bytes, metrics_port=config.worker_metrics_port,
                   insecure_internal=config.insecure_internal)


def scheduler_options(config: ClusterConfig) -> SchedulerOptions:
    return replace(config.scheduler, host=config.internal_host, port=config.scheduler_port,
                   worker=config.worker_address, max_num_batched_tokens=config.max_num_batched_tokens,
                   drain_timeout_s=config.drain_timeout_s, tls=config.tls.server() if config.tls else None,
                   worker_tls=config.tls.client() if config.tls else None,
                   max_message_bytes=config.internal_max_message_bytes,
                   metrics_port=config.scheduler_metrics_port, insecure_internal=config.insecure_internal)


def gateway_options(config: ClusterConfig) -> GatewayOptions:
    return replace(config.gateway, host=config.host, port=config.gateway_port, http_port=config.http_port or 0,
                   model=config.model, drain_timeout_s=config.drain_timeout_s, scheduler=(config.scheduler_address,),
                   tls=config.tls.server() if config.tls else None,
                   scheduler_tls=config.tls.client() if config.tls else None,
                   max_message_bytes=config.max_message_bytes, metrics_port=config.gateway_metrics_port)


def _argv(config: ClusterConfig, module: str, options: WorkerOptions | SchedulerOptions | GatewayOptions) -> list[str]:
    return [config.python, "-m", module, *options.to_argv(), *_plumbing_flags(options)]


def _plumbing_flags(options: WorkerOptions | SchedulerOptions | GatewayOptions) -> list[str]:
    """The flags plumbing declares for every service (TLS, message size, metrics, --insecure-internal,
    the gateway's --scheduler), from the options' composite fields: to_argv writes a service's own flags."""
    argv = [*(options.tls.argv() if options.tls else []), "--max-message-bytes", str(options.max_message_bytes)]
    for peer in ("worker", "scheduler"):
        client = getattr(options, f"{peer}_tls", None)
        argv += client.argv(peer) if client else []
    if options.metrics_port is not None:
        argv += ["--metrics-port", str(options.metrics_port)]
    if getattr(options, "insecure_internal", False):
        argv.append("--insecure-internal")
    for address in getattr(options, "scheduler", ()):  # the gateway's, one per replica
        argv += ["--scheduler", address]
    return argv


def restart_policies(policy: RestartPolicy | None = None, *, redis: bool = True) -> dict[str, RestartPolicy]:
    """Worker, scheduler and gateway are started again when they crash (the scheduler re-registers a
    restarted worker, gateways reconnect to a restarted scheduler), and so is the redis-server the
    cluster started (redis=True; pass False with ClusterConfig.redis_url: one started by somebody else
    is not ours to restart): its append-only file brings the records back, and the scheduler's
    writers replay what they kept in memory meanwhile (kvstore.state_writer, kvstore.token_streams)."""
    policy = policy or RestartPolicy()
    return {name: policy for name in ("worker", "scheduler", "gateway", *(("redis",) if redis else ()))}
