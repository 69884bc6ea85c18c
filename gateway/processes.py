"""The gateway as N processes on one port (`--processes N`): each a full gateway (its own event loop,
scheduler channels, tokenizer, grammar helpers), the kernel spreading new connections over them
(SO_REUSEPORT on the gRPC port and on the HTTP port). One event loop is one core; at GPU step rates the
per-token work of a few hundred streams needs several (issue 33).

    count = process_count(options)           # --processes, or 0: the cores the container's CPU quota gives
    group = GatewayGroup(options, count, child_main)   # in process 0 (the one started); spawns 1..count-1
    group.start(); await group.wait_ready(timeout_s)   # before process 0 serves: the port answers once all do
    ... SIGTERM: group.stop() passes it on; each process drains its own streams; await group.wait_exited()

Metrics: each process serves its own /metrics, on --metrics-port + its index (process 0 on the port given,
0: each picks a free one), so no process reports another's streams and a scrape config lists N targets.
Not one endpoint with prometheus_client's multiprocess mode: that needs a shared directory of mmap files
cleaned between runs, and drops the gauges and collectors (live streams, breakers) it cannot sum.

A child whose parent dies without passing SIGTERM on (SIGKILL) gets SIGTERM from the kernel
(PR_SET_PDEATHSIG) and drains as if told.
"""
from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import multiprocessing
import os
import signal
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path

from gateway.options import GatewayOptions

logger = logging.getLogger("tokenmill.gateway")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def container_cores() -> int:
    """The cores a container's CPU quota gives this process (cgroup v2 cpu.max, else v1 cfs_quota_us /
    cfs_period_us, rounded up, at most its CPU affinity); 1 without a quota. Not the host's core count: a
    process with no quota shares the host with what else runs there (a local cluster's scheduler and worker),
    and N tokenizers and grammar helpers on a 64-core box would be waste."""
    quota = _cgroup_quota()
    if quota is None:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, math.ceil(quota)))


def _cgroup_quota() -> float | None:
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def process_count(options: GatewayOptions) -> int:
    """--processes, or (0) the container's cores; one where the gRPC port is 0 (each would pick its own)."""
    return 1 if options.port == 0 else options.processes or container_cores()


def watch_parent() -> None:
    """In a child: SIGTERM when the parent dies (Linux; elsewhere a killed parent leaves it to its own SIGTERM)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def child_options(options: GatewayOptions, index: int) -> GatewayOptions:
    """Process index's options: one process, the shared port, its own metrics port (the docstring above)."""
    metrics_port = options.metrics_port
    if metrics_port:  # None: no endpoint; 0: each picks a free one
        metrics_port += index
    return replace(options, processes=1, reuse_port=True, metrics_port=metrics_port)


class GatewayGroup:
    """Process 0's view of the other N - 1: started, awaited ready, told to stop, awaited gone."""

    def __init__(self, options: GatewayOptions, count: int, child_main: Callable[..., None]) -> None:
        """child_main(options, index, ready): a child's body (gateway.main.serve_child), which sends its pid
        on ready once it serves."""
        self.options, self.count, self.child_main = options, count, child_main
        self._children: list[tuple[multiprocessing.Process, Connection]] = []

    def start(self) -> None:
        # spawn, not fork: this process has imported gRPC, whose threads a fork would not carry over
        context = multiprocessing.get_context("spawn")
        for index in range(1, self.count):
            reader, writer = context.Pipe(duplex=False)
            child = context.Process(target=self.child_main, args=(child_options(self.options, index), index, writer),
                                    name=f"gateway-{index}", daemon=False)
            child.start()
            writer.close()  # the child's end: EOF here once it exits
            self._children.append((child, reader))

    async def wait_ready(self, timeout_s: float) -> None:
        """Every child has reported ready; RuntimeError naming the first that exited or did not in time."""
        async with asyncio.timeout(timeout_s):
            for child, reader in self._children:
                try:
                    await asyncio.to_thread(reader.recv)
                except EOFError:
                    raise RuntimeError(f"gateway process {child.name} exited before it was ready "
                                       f"(exit code {child.exitcode})") from None

    def stop(self) -> None:
        """SIGTERM to each child still running: it drains its own streams, then exits."""
        for child, _ in self._children:
            if child.is_alive():
                os.kill(child.pid, signal.SIGTERM)

    async def wait_exited(self, timeout_s: float) -> None:
        """Waits up to timeout_s for the children to exit, then kills those left."""
        for child, reader in self._children:
            await asyncio.to_thread(child.join, timeout_s)
            if child.is_alive():
                logger.warning("gateway process %s did not exit %.0fs after SIGTERM: killed", child.name, timeout_s)
                child.kill()
            reader.close()

    @property
    def pids(self) -> list[int]:
        return [child.pid for child, _ in self._children]
