"""A real cluster (redis-server, worker, scheduler, gateway as separate processes) on the default model."""
from __future__ import annotations

import pytest

from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings
from tokenmill.cluster.specs import cluster_specs
from tokenmill.cluster.supervisor import Supervisor


@pytest.fixture(scope="package")
def cluster():
    config = resolve_ports(with_settings(ClusterConfig(), gateway_port=0, scheduler_port=0, worker_port=0, redis_port=0,
                                         kv_cache_mb=64, max_num_batched_tokens=256))
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300) as supervisor:
        yield config, supervisor
