"""A real cluster (redis-server, worker, scheduler, gateway as separate processes) on the default model: the
suite's shared one (tests/helpers/default_cluster.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cluster(default_cluster):
    return default_cluster
