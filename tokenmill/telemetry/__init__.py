"""Observability shared by every tokenmill process: OpenTelemetry tracing, Prometheus metrics, JSON logs.

    from tokenmill import telemetry
    telemetry.start_process("scheduler", metrics_port=args.metrics_port, host=args.host)  # in serve()

Tracing turns on only when the standard OTEL_* environment names an OTLP endpoint (see
tokenmill.telemetry.tracing); without it nothing is installed and the OpenTelemetry API hands out
no-op spans. Metrics are served only when a metrics port is given. docs/observability.md has the lot.
"""
from __future__ import annotations

from tokenmill.telemetry.process import start_process

__all__ = ["start_process"]
