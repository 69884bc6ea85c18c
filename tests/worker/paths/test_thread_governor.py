"""worker.paths.thread_governor: one torch thread while another process holds the cores, all of them otherwise.
The run-queue readings and the clock are scripted; the /proc reader is checked on this machine's kernel."""
from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest

from worker.paths.thread_governor import ThreadGovernor, process_run_delay_ns

STEP_NS = 10_000_000  # 10 ms steps


class Machine:
    """Run-queue wait that grows by `share` of each step's thread time, and a clock that steps along."""

    def __init__(self) -> None:
        self.delay_ns = 0
        self.now = 0.0
        self.share = 0.0
        self.threads_set: list[int] = []

    def governor(self, threads: int = 2) -> ThreadGovernor:
        return ThreadGovernor(threads, read_run_delay_ns=lambda: self.delay_ns, clock=lambda: self.now,
                              set_threads=self.threads_set.append, window_steps=4, first_retry_s=1.0,
                              max_retry_s=4.0, spinning=True)

    def steps(self, governor: ThreadGovernor, count: int) -> None:
        for _ in range(count):
            self.delay_ns += int(self.share * STEP_NS * governor.current)
            self.now += STEP_NS / 1e9
            governor.after_step(STEP_NS)


def test_a_quiet_machine_keeps_every_thread():
    machine = Machine()
    governor = machine.governor()
    machine.share = 0.05  # the cluster's own gateway and scheduler now and then
    machine.steps(governor, 100)
    assert governor.current == 2 and machine.threads_set == []
    assert abs(governor.last_share - 0.05) < 1e-9


def test_contention_drops_to_one_thread_and_retries_with_growing_waits():
    machine = Machine()
    governor = machine.governor()
    switches: list[tuple[float, int]] = []
    governor._set = lambda threads: switches.append((round(machine.now, 2), threads))
    machine.share = 0.6  # a CPU hog beside the worker
    machine.steps(governor, 5)  # one window (the first step starts it)
    assert governor.current == 1 and switches == [(0.05, 1)]
    machine.steps(governor, 1200)  # 12 s of hog: tries after 1, 2, 4, 4 s, each back to one thread a window later
    tries = [at for at, threads in switches if threads == 2]
    drops = [at for at, threads in switches if threads == 1]
    # (the clock moves in 10 ms steps of float additions: a retry lands on the step at or just after it)
    assert [b - a for a, b in zip(drops, tries)] == pytest.approx([1.0, 2.0, 4.0, 4.0], abs=0.011)
    assert [d - t for t, d in zip(tries, drops[1:])] == pytest.approx([0.05] * 4, abs=0.011)  # a try: one window
    assert governor.current == 1 and governor.retry_s == 4.0
    machine.share = 0.05  # the hog is gone: the next try keeps every thread and the wait starts over
    machine.steps(governor, 500)
    assert governor.current == 2 and governor.retry_s == 1.0 and switches[-1][1] == 2


def test_nothing_to_govern_on_one_thread_without_schedstat_or_under_passive_waits():
    machine = Machine()
    machine.share = 0.9
    one = machine.governor(threads=1)
    machine.steps(one, 20)
    blind = ThreadGovernor(2, read_run_delay_ns=lambda: None, clock=lambda: machine.now,
                           set_threads=machine.threads_set.append, spinning=True)
    blind.after_step(STEP_NS)
    passive = ThreadGovernor(2, read_run_delay_ns=lambda: machine.delay_ns, set_threads=machine.threads_set.append,
                             spinning=False)  # sleeping threads do not collapse beside a busy process
    machine.steps(passive, 20)
    assert not one.enabled and not blind.enabled and not passive.enabled and machine.threads_set == []


def test_run_delay_of_this_process_is_read_from_proc_and_grows_when_threads_wait():
    before = process_run_delay_ns()
    assert isinstance(before, int) and before >= 0

    def hash_for(seconds: float) -> None:  # hashlib releases the GIL on large buffers: the threads run at once
        data, deadline = b"x" * (1 << 20), time.monotonic() + seconds
        while time.monotonic() < deadline:
            hashlib.sha256(data).digest()

    # more runnable threads than this machine has cores: some wait on a run queue
    threads = [threading.Thread(target=hash_for, args=(0.3,)) for _ in range(2 * (os.cpu_count() or 1) + 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert process_run_delay_ns() > before


def test_threads_spin_unless_the_environment_says_passive(monkeypatch):
    from worker.paths.thread_governor import threads_spin

    for value, spins in (("PASSIVE", False), ("passive", False), ("ACTIVE", True), ("", True)):
        monkeypatch.setenv("OMP_WAIT_POLICY", value)
        assert threads_spin() is spins
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert threads_spin()
