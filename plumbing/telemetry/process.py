"""What each process's serve() calls first: tracing from the environment, the metrics endpoint.

    telemetry_handle = await start_process("gateway", metrics_port=args.metrics_port, host=args.host)

It must run before the process creates any gRPC server or channel: the gRPC instrumentation wraps
grpc.aio.server / insecure_channel as they are called.
"""
from __future__ import annotations

import logging

from aiohttp import web

from plumbing.telemetry.logs import set_service
from plumbing.telemetry.metrics import REGISTRY, VLLM_REGISTRY, register_owned, triton_text
from plumbing.telemetry.tracing_setup import setup_tracing

logger = logging.getLogger(__name__)


async def start_process(service: str, metrics_port: int | None = None, host: str = "127.0.0.1") -> web.AppRunner | None:
    """Sets up tracing (if OTEL_* asks for it) and serves /metrics on metrics_port (None: no endpoint).

    Returns the metrics server's runner (None without one)."""
    set_service(service)
    setup_tracing(service)
    register_owned(service)  # only what this process updates: no histograms that never move
    if metrics_port is None:
        return None
    return await start_metrics_server(host, metrics_port)


async def start_metrics_server(host: str, port: int) -> web.AppRunner:
    """Prometheus text at http://host:port/metrics, served from this event loop (so collectors that
    read loop-owned state, like the scheduler's, never race the loop)."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    async def metrics(request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(REGISTRY) + generate_latest(VLLM_REGISTRY) + triton_text())
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as error:
        await runner.cleanup()
        raise SystemExit(f"cannot serve metrics on {host}:{port} ({error.strerror}); change --metrics-port") from None
    logger.info("metrics on http://%s:%d/metrics", host, port)
    return runner
