"""What every tokenmill process does around its servers: logging, the event loop, stop signals."""
from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Coroutine

from plumbing.telemetry.logs import configure_logging


def run_process(main: Coroutine) -> None:
    """Runs a process's main coroutine on uvloop (plain asyncio where uvloop is missing).

    Logs go to stderr as text, or as JSON lines with trace and request ids when
    TOKENMILL_LOG_FORMAT=json (plumbing.telemetry.logs)."""
    configure_logging(os.environ.get("TOKENMILL_LOG_FORMAT", "text").strip().lower() or "text")
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


async def wait_for_stop_signal() -> None:
    """Returns on the first SIGTERM or SIGINT (the supervisor and Kubernetes stop us with SIGTERM)."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancels a background task and waits until it has unwound (its finally blocks ran); None: nothing."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
