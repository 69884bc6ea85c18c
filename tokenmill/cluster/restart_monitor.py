"""The supervisor's watcher thread: starts crashed children again under their RestartPolicy.

A child counts as crashed when it exited without the supervisor stopping or killing it on purpose
(ChildProcess.exit_expected). The restarted child is not waited for: the processes that depend on it
notice it coming back by themselves (the scheduler re-registers a new worker, gateways reconnect).

A child with a policy is never given up. One that crashes more than max_restarts times within window_s
is *crash-looping*: it is restarted every backoff_max_s for as long as it keeps crashing, while every
other child keeps serving (before, the supervisor gave it up and `tokenmill serve` stopped the whole
cluster, so one request that crashed the gateway six times in a minute took every worker down with
it). Each child's restart is scheduled, not slept on, so one child's long backoff never delays
noticing or restarting another.

The one crash that still ends `tokenmill serve`: a child that dies before it is ready on its FIRST
start. That happens inside Supervisor.start(), before this monitor runs, and is a configuration
error (a model file that is not there, a port taken) that restarting cannot fix; start() stops what
it started and raises ChildExited with the child's output. Readiness is the line, not a run time:
a child that was once ready and then crashes, however soon, is restarted.

How a crash loop is reported (the `serve` process has no health or metrics endpoint of its own; each
child serves its own /metrics and grpc.health, which the crashing child cannot answer):

- the supervisor's log: "gateway is crash-looping (6 crashes in 60s): restarting it every 10s; the
  other children keep serving", then each restart, then "gateway recovered: no crash in 60s";
- Supervisor.child_states(): per child, alive/pid, restarts, crashes in the window, crash-looping and
  the last exit; run_until_stopped() prints the children that restarted when `serve` ends.
"""
from __future__ import annotations

import threading
import time
from typing import Protocol

from tokenmill.cluster.child_process import ChildProcess
from tokenmill.cluster.restart_policy import RestartHistory


class RestartTarget(Protocol):
    """What the monitor needs of the supervisor it serves (the Supervisor is one): the monitor sits
    below it, so the supervisor imports the monitor and never the other way round."""

    children: dict[str, ChildProcess]
    restarts: dict[str, RestartHistory]  # the children it restarts, each with its history
    poll_interval_s: float
    lifecycle_lock: threading.Lock  # held while a child is started

    def say(self, text: str) -> None: ...


class RestartMonitor:
    def __init__(self, supervisor: RestartTarget) -> None:
        self._supervisor = supervisor
        # crashed children waiting out their backoff: name -> (monotonic time to restart, crashed pid)
        self._pending: dict[str, tuple[float, int | None]] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="restart-monitor", daemon=True)

    def handles(self, name: str) -> bool:
        """True if crashes of this child are restarted rather than reported as ChildExited."""
        return name in self._supervisor.restarts

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        supervisor = self._supervisor
        while not self._stopping.wait(supervisor.poll_interval_s):
            for name, history in supervisor.restarts.items():
                if self._stopping.is_set():
                    return
                now = time.monotonic()
                if name in self._pending:
                    restart_at, crashed_pid = self._pending[name]
                    if now >= restart_at:
                        del self._pending[name]
                        self._restart(name, crashed_pid)
                elif self._crashed(name):
                    self._schedule_restart(name, history)
                elif history.recovered(now):
                    supervisor.say(f"{name} recovered: no crash in {history.policy.window_s:g}s")

    def _schedule_restart(self, name: str, history: RestartHistory) -> None:
        supervisor = self._supervisor
        child = supervisor.children[name]
        crashed_pid = child.pid
        child.drain_output()
        how = child.describe_exit()
        now = time.monotonic()
        was_looping = history.state(now).crash_looping
        delay = history.record_crash(now, how)
        state = history.state(now)
        policy = history.policy
        if state.crash_looping and not was_looping:
            supervisor.say(f"{name} is crash-looping ({state.crashes_in_window} crashes in {policy.window_s:g}s): "
                           f"restarting it every {policy.backoff_max_s:g}s; the other children keep serving")
        looping = ", crash-looping" if state.crash_looping else ""
        supervisor.say(f"{name} {how}: restarting in {delay:.1f}s (restart {state.num_restarts}{looping})")
        self._pending[name] = (now + delay, crashed_pid)

    def _crashed(self, name: str) -> bool:
        child = self._supervisor.children[name]
        return child.returncode is not None and not child.exit_expected

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
