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

from plumbing.rpc import GENERATION_SERVICE, SCHEDULER_SERVICE, WORKER_SERVICE
from plumbing.tls import ClusterTLS
from tokenmill.cluster.child_process import ChildSpec
from tokenmill.cluster.config import METRICS_PORTS, ClusterConfig
from tokenmill.cluster.redis_process import redis_spec
from tokenmill.cluster.restart_policy import RestartPolicy

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
    """Children in start order: [redis,] worker, scheduler, gateway. Ports must be resolved already."""
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
