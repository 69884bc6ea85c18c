"""What every tokenmill process does around its servers: logging, the event loop, stop signals."""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Coroutine

from plumbing.telemetry.logs import configure_logging

logger = logging.getLogger(__name__)

# Set to "1" by the supervisor (tokenmill.cluster.child_process) in its children's environment: a child whose
# parent went away (the supervisor SIGKILLed or crashed: the child is reparented) stops as on SIGTERM rather than
# run on orphaned, holding its port, its cores and a GPU's memory. Unset (Kubernetes, docker-compose, a shell),
# nothing watches: a process started by hand outlives its shell as before.
EXIT_WITH_PARENT_ENV = "TOKENMILL_EXIT_WITH_PARENT"
PARENT_CHECK_INTERVAL_S = 1.0
_parent_at_start: int | None = None  # the parent when run_process began (before a model load of minutes)
# Allocations between young-generation collections once a service serves (CPython's default: 700). A step
# loop allocates several short-lived objects per request and step (outputs, token lists, messages), so at the
# default a collection runs every few hundred requests' worth, and its survivors push the older generations
# into full collections over the whole heap. scripts/bench_scheduler_step.py at 512 requests, alternated:
# 16.1-19.7 -> 14.2-14.5 us of scheduler CPU a token (the collector off altogether: 13.7-14.5).
GEN0_THRESHOLD = 20_000


def run_process(main: Coroutine) -> None:
    """Runs a process's main coroutine on uvloop (plain asyncio where uvloop is missing).

    Logs go to stderr as text, or as JSON lines with trace and request ids when
    TOKENMILL_LOG_FORMAT=json (plumbing.telemetry.logs)."""
    global _parent_at_start
    _parent_at_start = os.getppid()
    configure_logging(os.environ.get("TOKENMILL_LOG_FORMAT", "text").strip().lower() or "text")
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def settle_heap() -> None:
    """Called once a service is up: what it allocated while starting (modules, protobuf descriptors, a model's
    and a page pool's Python objects) lives as long as the process, so it leaves the cyclic collector's sight
    (gc.freeze, as vLLM and SGLang do after start-up), and young collections become rarer (GEN0_THRESHOLD)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])


async def wait_for_stop_signal() -> None:
    """Returns on the first SIGTERM or SIGINT (the supervisor and Kubernetes stop us with SIGTERM), or, with
    TOKENMILL_EXIT_WITH_PARENT=1, once the process that started this one is gone."""
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    watch = None
    if os.environ.get(EXIT_WITH_PARENT_ENV) == "1":
        parent = _parent_at_start if _parent_at_start is not None else os.getppid()
        watch = asyncio.get_running_loop().create_task(_stop_when_orphaned(parent, stop))
    try:
        await stop.wait()
    finally:
        await cancel_and_wait(watch)


async def _stop_when_orphaned(parent: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent:
        await asyncio.sleep(PARENT_CHECK_INTERVAL_S)
    logger.warning("the process that started this one (pid %d) is gone: stopping as on SIGTERM", parent)
    stop.set()


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancels a background task and waits until it has unwound (its finally blocks ran); None: nothing."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
