"""One real cluster (redis-server, worker, scheduler, gateway) on the default model, shared by the gateway
tests that drive public protocols through unmodified clients (KServe v2 via tritonclient, reflection).
Started on first use only, so the fast unit tests in this folder never pay for it."""
from __future__ import annotations

import openai
import pytest

from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings
from tokenmill.cluster.specs import cluster_specs
from tokenmill.cluster.supervisor import Supervisor


@pytest.fixture(scope="package")
def gateway_cluster() -> ClusterConfig:
    config = resolve_ports(with_settings(ClusterConfig(), gateway_port=0, http_port=0, scheduler_port=0, worker_port=0,
                                         redis_port=0, kv_cache_mb=64, max_num_batched_tokens=256))
    with Supervisor(cluster_specs(config), echo=False, startup_timeout_s=300):
        yield config


@pytest.fixture(scope="module")
def client(gateway_cluster) -> openai.OpenAI:
    """The official client on the shared cluster's OpenAI API; no retries: a retried 5xx would hide the
    status under test and slow the run."""
    return openai.OpenAI(base_url=f"http://{gateway_cluster.http_address}/v1", api_key="x", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id
