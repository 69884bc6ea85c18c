"""The supervisor's watcher thread: starts crashed children again under their RestartPolicy.

A child counts as crashed when it exited without the supervisor stopping or killing it on purpose
(ChildProcess.exit_expected). The restarted child is not waited for: the processes that depend on it
notice it coming back by themselves (the scheduler re-registers a new worker, gateways reconnect).
A child that crashes more often than its policy allows is given up: from then on the supervisor's
check()/wait() report it as ChildExited, as for a child without a policy.
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.supervisor import Supervisor


class RestartMonitor:
    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor
        self._given_up: set[str] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="restart-monitor", daemon=True)

    def handles(self, name: str) -> bool:
        """True while crashes of this child are restarted rather than reported."""
        return name in self._supervisor.restarts and name not in self._given_up

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        supervisor = self._supervisor
        while not self._stopping.wait(supervisor.poll_interval_s):
            for name, history in supervisor.restarts.items():
                if not self._crashed(name):
                    continue
                child = supervisor.children[name]
                crashed_pid = child.pid
                child.drain_output()
                delay = history.next_delay(time.monotonic())
                if delay is None:
                    policy = history.policy
                    supervisor.say(f"{name} {child.describe_exit()}: crashed more than {policy.max_restarts} "
                                    f"times in {policy.window_s:g}s, giving up")
                    self._given_up.add(name)
                    continue
                supervisor.say(f"{name} {child.describe_exit()}: restarting in {delay:.1f}s "
                                f"(restart {history.num_restarts})")
                if self._stopping.wait(delay):
                    return
                self._restart(name, crashed_pid)

    def _crashed(self, name: str) -> bool:
        child = self._supervisor.children[name]
        return name not in self._given_up and child.returncode is not None and not child.exit_expected

    def _restart(self, name: str, crashed_pid: int | None) -> None:
        supervisor = self._supervisor
        with supervisor.lifecycle_lock:
            # during the backoff somebody may have started it again (Supervisor.restart) or stopped it
            if not self._crashed(name) or supervisor.children[name].pid != crashed_pid:
                return
            child = supervisor.children[name]
            try:
                child.start()
            except Exception as error:  # noqa: BLE001 - this thread must outlive one failed start
                # e.g. fork failing under memory pressure: the old process is still the one recorded, so
                # the next pass counts one more crash; a dead monitor would leave every later crash
                # unrestarted and unreported
                supervisor.say(f"restarting {name} failed: {error!r}")
                return
        supervisor.say(f"restarted {name} (pid {child.pid})")
