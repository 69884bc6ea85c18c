"""A real redis-server on a free loopback port, for tests; stoppable and restartable mid-test.

Fixtures (exposed through tests/conftest.py):
  redis_server   session-scoped RedisServer shared by every test; never stop it in a test
  fresh_redis    the shared server's URL with its database flushed first
  own_redis      a function-scoped RedisServer of the test's own, for tests that stop/restart Redis
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

REDIS_SERVER_BINARY = "redis-server"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One redis-server process with no persistence, in its own temp dir."""

    def __init__(self, port: int | None = None) -> None:
        binary = shutil.which(REDIS_SERVER_BINARY)
        if binary is None:
            pytest.skip(f"{REDIS_SERVER_BINARY} not on PATH (apt-get install redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="tokenmill-redis-"))
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start on self.port (the same port after a stop) and wait until it answers PING."""
        assert self.process is None, "redis-server already running"
        log = open(self.directory / "redis.log", "ab")
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)
        try:
            while True:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} exited: {self.log_tail()}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.ConnectionError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"redis-server on port {self.port} silent after {timeout_s}s")
                time.sleep(0.02)
        finally:
            client.close()

    def stop(self) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def flush(self) -> None:
        with redis.Redis(host="127.0.0.1", port=self.port) as client:
            client.flushdb()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def log_tail(self, num_chars: int = 2000) -> str:
        path = self.directory / "redis.log"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.close()


@pytest.fixture
def fresh_redis(redis_server: RedisServer) -> str:
    if redis_server.process is None:  # a test stopped the shared server after all; bring it back
        redis_server.start()
    redis_server.flush()
    return redis_server.url


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.close()
