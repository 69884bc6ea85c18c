"""Background calls start no trace by default, and TOKENMILL_TRACE_BACKGROUND=true brings them back:
a real process runs the scheduler's Redis health watch (a PING every 0.1 s here) against a real
redis-server, exporting to a real OTLP receiver."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.helpers.otlp_receiver import OtlpReceiver

WATCH = """
import asyncio, sys
from plumbing.telemetry.tracing import shutdown_tracing
from plumbing.telemetry.tracing_setup import setup_tracing
from kvstore.redis_health import watch_redis
assert setup_tracing("scheduler")

async def report(ok):
    pass

async def main():
    task = asyncio.create_task(watch_redis(sys.argv[1], lambda: True, report, interval_s=0.1))
    await asyncio.sleep(1.0)
    task.cancel()

asyncio.run(main())
shutdown_tracing()
"""


def redis_spans_from_health_watch(redis_url: str, receiver: OtlpReceiver, trace_background: bool) -> list:
    environ = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ".", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
               "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_TRACES_SAMPLER": "always_on",
               "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": f"watch-{trace_background}"}
    if trace_background:
        environ["TOKENMILL_TRACE_BACKGROUND"] = "true"
    done = subprocess.run([sys.executable, "-c", WATCH, redis_url], env=environ, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    time.sleep(0.3)  # the exporter flushed at shutdown; the receiver's thread may still be storing
    return [s for s in receiver.snapshot() if s.service == f"watch-{trace_background}"]


@pytest.mark.parametrize("trace_background", [False, True])
def test_health_pings_are_traced_only_when_asked(fresh_redis, trace_background):
    with OtlpReceiver() as receiver:
        spans = redis_spans_from_health_watch(fresh_redis, receiver, trace_background)
    if trace_background:
        assert len([s for s in spans if s.name == "PING" and s.parent_span_id == ""]) >= 5
    else:
        assert spans == []
