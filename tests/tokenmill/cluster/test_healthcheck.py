"""`python -m tokenmill.cluster.healthcheck` (the containers' health check) as a real process against a real
server: readiness follows set_ready, liveness does not, and nobody listening is a failure."""
from __future__ import annotations

import asyncio
import sys

from plumbing import rpc
from tokenmill.cluster.readiness import free_port


async def _healthcheck(*args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "tokenmill.cluster.healthcheck", *args,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    return process.returncode, out.decode()


async def test_exit_status_follows_readiness():
    server = rpc.create_server()
    health = rpc.add_health_and_reflection(server, [rpc.WORKER_SERVICE])
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    try:
        assert await _healthcheck(address, rpc.WORKER_SERVICE) == (1, f"{address} {rpc.WORKER_SERVICE}: NOT_SERVING\n")
        code, out = await _healthcheck(address)  # liveness: up before warm-up
        assert code == 0 and "SERVING" in out
        await health.set_ready(True)
        assert (await _healthcheck(address, rpc.WORKER_SERVICE))[0] == 0
        code, out = await _healthcheck(address, "tokenmill.v1.NoSuchService")
        assert code == 1 and "NOT_FOUND" in out
    finally:
        await server.stop(None)
    code, out = await _healthcheck(f"127.0.0.1:{free_port()}", "--timeout-s", "1")
    assert code == 1 and "UNAVAILABLE" in out
