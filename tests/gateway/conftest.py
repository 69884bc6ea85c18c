"""One real cluster (redis-server, worker, scheduler, gateway) on the default model, shared by the gateway
tests that drive public protocols through unmodified clients (KServe v2 via tritonclient, reflection).
Started on first use only, so the fast unit tests in this folder never pay for it."""
from __future__ import annotations

import pytest

from tokenmill.cluster import ClusterConfig, cluster_specs, resolve_ports
from tokenmill.supervisor import Supervisor


@pytest.fixture(scope="package")
def gateway_cluster() -> ClusterConfig:
    config = resolve_ports(ClusterConfig(gateway_port=0, http_port=0, scheduler_port=0, worker_port=0,
                                         redis_port=0, kv_cache_mb=64, max_num_batched_tokens=256))
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300):
        yield config
