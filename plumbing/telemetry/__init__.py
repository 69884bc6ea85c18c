"""Observability shared by every tokenmill process: OpenTelemetry tracing, Prometheus metrics, JSON logs.

    from plumbing import telemetry
    telemetry.start_process("scheduler", metrics_port=args.metrics_port, host=args.host)  # in serve()

Tracing turns on only when the standard OTEL_* environment names an OTLP endpoint (see
plumbing.telemetry.tracing); without it nothing is installed and the OpenTelemetry API hands out
no-op spans. Metrics are served only when a metrics port is given. docs/observability.md has the lot.
"""
from __future__ import annotations

import argparse

__all__ = ["add_metrics_argument", "start_process"]


def add_metrics_argument(parser: argparse.ArgumentParser) -> None:
    """--metrics-port, the same on gateway, scheduler and worker (deploy/ and tokenmill serve pass it)."""
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")


async def start_process(service: str, metrics_port: int | None = None, host: str = "127.0.0.1"):
    """See plumbing.telemetry.process.start_process (imported here only when called: the other
    submodules, which plumbing.rpc and the CLI import, stay light)."""
    from plumbing.telemetry.process import start_process as start

    return await start(service, metrics_port, host)
