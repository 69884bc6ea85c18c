"""One torch thread instead of all of them while another process holds the cores the worker needs.

The worker's OpenMP threads spin briefly between parallel regions (tokenmill/cluster/specs.py:
torch_thread_env): a decode step is ~180 regions tens of microseconds apart, and spinning instead of
sleeping halves the served model's inter-token latency on cores the cluster has to itself. Where another
process is runnable on those cores, each region's threads wait for a partner the kernel has descheduled,
spinning on the core that partner needs, and a step takes many times longer (measured: 2.6 tok/s
against 32.7 beside a CPU hog). One thread never waits for another: every region runs inline.

The governor reads how long this process's threads waited on a run queue (Linux schedstat) during the
last few steps. When that wait is a large share of the steps' time, it drops to one thread; after a
while it tries all of them again for a few steps, waiting longer before each next try while the
contention lasts (each try costs a few slow steps). Called on the compute thread after each forward
(torch.set_num_threads sets the calling thread's OpenMP team size).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# Share of the steps' thread time spent waiting on a run queue beyond which the cores count as taken:
# measured on the served default model, 2 cores, windows of 8 steps: 3-17% (once 28%) with only the
# cluster's own gateway and scheduler beside the worker, 48-49% beside a CPU hog.
CONTENDED_SHARE = 0.35
WINDOW_STEPS = 8  # steps per measurement
FIRST_RETRY_S = 10.0  # one thread this long, then all threads again for a window
MAX_RETRY_S = 160.0  # the wait doubles while contention persists, up to this


def threads_spin() -> bool:
    """Whether idle OpenMP threads spin (anything but OMP_WAIT_POLICY=PASSIVE): only then does a busy
    neighbour make them collapse. Under PASSIVE the governor stays off, so thread counts (and the float
    order of the few reductions that depend on them) never change mid-run, as the test suite relies on."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() != "PASSIVE"


def process_run_delay_ns() -> int | None:
    """Nanoseconds this process's threads have waited on a run queue, in all (the second field of each
    /proc/self/task/<tid>/schedstat); None where the kernel does not expose it."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stat:
                total += int(stat.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total


class ThreadGovernor:
    def __init__(self, threads: int, *, read_run_delay_ns: Callable[[], int | None] = process_run_delay_ns,
                 clock: Callable[[], float] = time.monotonic, set_threads: Callable[[int], None] = torch.set_num_threads,
                 contended_share: float = CONTENDED_SHARE, window_steps: int = WINDOW_STEPS,
                 first_retry_s: float = FIRST_RETRY_S, max_retry_s: float = MAX_RETRY_S,
                 spinning: bool | None = None) -> None:
        self.threads = threads  # what the worker was given; the governor only ever goes down to 1 and back
        self.current = threads
        self._read, self._clock, self._set = read_run_delay_ns, clock, set_threads
        self.contended_share, self.window_steps = contended_share, window_steps
        self.first_retry_s, self.max_retry_s = first_retry_s, max_retry_s
        self.retry_s = first_retry_s
        self.retry_at: float | None = None  # while on one thread: when to try all again
        spinning = threads_spin() if spinning is None else spinning
        self.enabled = spinning and threads > 1 and read_run_delay_ns() is not None
        self._steps = 0
        self._step_ns = 0
        self._delay_at_start: int | None = None
        self.last_share: float | None = None  # the last window's measure, for logs and tests

    def after_step(self, step_ns: int) -> None:
        """step_ns: the forward pass's wall time. Cheap: reads /proc once per window."""
        if not self.enabled:
            return
        if self.current == 1:
            if self._clock() >= self.retry_at:
                self._switch(self.threads)  # a try: the next window decides
            return
        if self._delay_at_start is None:
            self._delay_at_start = self._read()
            self._steps = self._step_ns = 0
            return
        self._steps += 1
        self._step_ns += step_ns
        if self._steps < self.window_steps:
            return
        delay = self._read()
        if delay is None or self._step_ns <= 0:
            self.enabled = False
            return
        self.last_share = (delay - self._delay_at_start) / (self._step_ns * self.threads)
        self._delay_at_start = None
        log.debug("run-queue wait %.1f%% of %d threads' time over %d steps", 100 * self.last_share, self.threads,
                  self.window_steps)
        if self.last_share > self.contended_share:
            if self.retry_at is not None:  # a try that found the cores still taken
                self.retry_s = min(self.retry_s * 2, self.max_retry_s)
            self.retry_at = self._clock() + self.retry_s
            log.warning("torch threads %d -> 1: the worker's threads waited %.0f%% of the last %d steps on a run "
                        "queue (another process holds the cores); trying %d again in %.0f s", self.threads,
                        100 * self.last_share, self.window_steps, self.threads, self.retry_s)
            self._switch(1)
        elif self.retry_at is not None:
            log.info("torch threads back to %d: run-queue wait %.0f%% of the last %d steps", self.threads,
                     100 * self.last_share, self.window_steps)
            self.retry_at, self.retry_s = None, self.first_retry_s

    def _switch(self, threads: int) -> None:
        self._set(threads)
        self.current = threads
        self._delay_at_start = None
