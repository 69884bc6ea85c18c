"""The gateway tests that drive public protocols through unmodified clients (KServe v2 via tritonclient,
reflection, OpenAI) run on the suite's shared cluster on the default model (tests/helpers/default_cluster.py).
Started on first use only, so the fast unit tests in this folder never pay for it."""
from __future__ import annotations

import openai
import pytest

from tokenmill.cluster.config import ClusterConfig


@pytest.fixture(scope="session")
def gateway_cluster(default_cluster) -> ClusterConfig:
    return default_cluster[0]


@pytest.fixture(scope="module")
def client(gateway_cluster) -> openai.OpenAI:
    """The official client on the shared cluster's OpenAI API; no retries: a retried 5xx would hide the
    status under test and slow the run."""
    return openai.OpenAI(base_url=f"http://{gateway_cluster.http_address}/v1", api_key="x", max_retries=0,
                         timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id
