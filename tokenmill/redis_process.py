"""A local redis-server as a supervised child: no persistence, loopback only, its own temp dir."""
from __future__ import annotations

import shutil
from functools import partial

from tokenmill.child_process import ChildSpec
from tokenmill.readiness import redis_ping_probe

REDIS_SERVER_BINARY = "redis-server"


def find_redis_server() -> str:
    binary = shutil.which(REDIS_SERVER_BINARY)
    if binary is None:
        raise FileNotFoundError(
            f"{REDIS_SERVER_BINARY} is not on PATH: install it (apt-get install redis-server) "
            f"or point tokenmill at a running Redis with --redis-url")
    return binary


def redis_url(port: int) -> str:
    return f"redis://127.0.0.1:{port}/0"


def redis_spec(port: int, binary: str | None = None, port_hint: str = "--redis-port") -> ChildSpec:
    """redis-server on 127.0.0.1:port. Request state is bookkeeping that a restart may lose (see
    DESIGN.md: Redis is never on the hot path), so nothing is saved: no RDB snapshots, no AOF."""
    argv = [binary or find_redis_server(), "--port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", ".", "--loglevel", "warning"]
    return ChildSpec("redis", argv, None, f"127.0.0.1:{port}", probe=partial(redis_ping_probe, "127.0.0.1", port),
                     port_hint=port_hint, use_temp_dir=True)
