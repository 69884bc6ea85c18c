"""One real cluster (redis-server, worker, scheduler, gateway with its HTTP API) on the default model, shared by
every test that drives it: the gateway's public-protocol tests, tests/e2e/test_cluster.py and the client's.

Session-scoped, not package-scoped: under `pytest -n 2 --dist loadfile` a worker runs files of other folders
between two gateway files, and a package-scoped cluster was stopped and started again each time (about ten
starts of ~20-35 s on CI's 2 cores, where now each worker starts it once, on first use). No test stops or
restarts its children; tests that do start clusters of their own."""
from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def default_cluster() -> Iterator:
    """(ClusterConfig, Supervisor) of the shared cluster."""
    from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings
    from tokenmill.cluster.specs import cluster_specs
    from tokenmill.cluster.supervisor import Supervisor

    config = resolve_ports(with_settings(ClusterConfig(), gateway_port=0, http_port=0, scheduler_port=0, worker_port=0,
                                         redis_port=0, kv_cache_mb=64, max_num_batched_tokens=256))
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300) as supervisor:
        yield config, supervisor
