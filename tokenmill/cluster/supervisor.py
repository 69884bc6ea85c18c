"""The local process supervisor: starts children in order, each only once the previous is ready, and
stops them in reverse order. `tokenmill serve`, the end-to-end tests and the benchmarks use it.

    supervisor = Supervisor([ChildSpec("redis", [...], None, "127.0.0.1:6379", probe=...),
                             ChildSpec("worker", [...], "tokenmill.v1.Worker", "127.0.0.1:50053"), ...])
    supervisor.start()                  # raises ChildExited / StartupTimeout / PortInUse; stops what it started
    supervisor.address("gateway")       # "127.0.0.1:50051"
    supervisor.kill("worker")           # kill -9 one child on purpose (not reported as a failure)
    supervisor.wait()                   # until request_stop(); raises ChildExited if a child dies
                                        # (one with a RestartPolicy is started again, with backoff,
                                        # however often it crashes: the others keep serving)
    supervisor.child_states()           # per child: alive, restarts, crash-looping, last exit
    supervisor.stop()                   # gateway, scheduler, worker, redis: SIGTERM, grace, SIGKILL

Children start one at a time because each needs the one before it (the scheduler registers with the
worker, the gateway connects to the scheduler), and so a failure names the first broken component.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from plumbing.telemetry.logs import echo_line
from tokenmill.cluster.child_process import ChildProcess, ChildSpec, Probe
from tokenmill.cluster.readiness import GrpcHealthProbe, port_in_use
from tokenmill.cluster.restart_monitor import RestartMonitor
from tokenmill.cluster.restart_policy import RestartHistory, RestartPolicy, RestartState

__all__ = ["ChildSpec", "ChildState", "Supervisor", "SupervisorError", "ChildExited", "StartupTimeout",
           "PortInUse", "StopRequested", "run_until_stopped"]


class SupervisorError(Exception):
    """A cluster could not be started or kept running; str() is the message for the user."""


class ChildExited(SupervisorError):
    def __init__(self, name: str, how: str, returncode: int, tail: list[str], during_startup: bool) -> None:
        self.name, self.returncode, self.tail, self.during_startup = name, returncode, tail, during_startup
        when = "during startup" if during_startup else "unexpectedly"
        lines = "\n".join(f"  [{name}] {line}" for line in tail) or "  (no output)"
        super().__init__(f"{name} {how} {when}; its last output:\n{lines}")


class StartupTimeout(SupervisorError):
    def __init__(self, name: str, timeout_s: float, last_status: str, tail: list[str]) -> None:
        self.name, self.tail = name, tail
        lines = "\n".join(f"  [{name}] {line}" for line in tail[-20:]) or "  (no output)"
        super().__init__(f"{name} not ready after {timeout_s:g}s (last seen: {last_status}); "
                         f"raise --startup-timeout-s if it is just slow; its last output:\n{lines}")


class PortInUse(SupervisorError):
    def __init__(self, name: str, address: str, hint: str) -> None:
        self.name, self.address = name, address
        change = f"; change it with {hint}" if hint else ""
        super().__init__(f"port {address.rpartition(':')[2]} for {name} is already in use on "
                         f"{address.rpartition(':')[0]}{change}")


class StopRequested(SupervisorError):
    def __init__(self) -> None:
        super().__init__("stop requested")


@dataclass(frozen=True, slots=True)
class ChildState:
    """One child as Supervisor.child_states() sees it (restart fields stay zero without a RestartPolicy)."""

    name: str
    alive: bool
    pid: int | None
    restarts: int  # crashes the restart monitor has restarted (or is about to)
    crashes_in_window: int  # crashes within its policy's window_s
    crash_looping: bool  # restarted every backoff_max_s until a window_s without a crash
    last_exit: str  # how it last crashed, "exited with code 1"; "" if it never did

    def describe(self) -> str:
        """'gateway: 7 restarts, crash-looping (6 crashes in the window), last exited with code 1'"""
        looping = f", crash-looping ({self.crashes_in_window} crashes in the window)" if self.crash_looping else ""
        last = f", last {self.last_exit}" if self.last_exit else ""
        return f"{self.name}: {self.restarts} restarts{looping}{last}"


class Supervisor:
    def __init__(self, specs: Sequence[ChildSpec], *, echo: TextIO | bool = True, tail_lines: int = 50,
                 startup_timeout_s: float = 300.0, grace_s: float = 10.0, progress_interval_s: float = 5.0,
                 poll_interval_s: float = 0.1, restart_policies: dict[str, RestartPolicy] | None = None) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique, got {names}")
        # True: sys.stderr as it is now (not at import, so pytest's capture sees it); False: quiet
        echo = sys.stderr if echo is True else (echo or None)
        self._echo = echo
        self._echo_lock = threading.Lock()
        self.children = {spec.name: ChildProcess(spec, echo, self._echo_lock, tail_lines) for spec in specs}
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.progress_interval_s = progress_interval_s
        self.poll_interval_s = poll_interval_s
        # Plain flags, not threading.Event: they are set from signal handlers, which must not take locks.
        self.stop_requested = False
        self.force_stop = False
        # children started again when they crash (restart_monitor.py); others end the cluster
        unknown = set(restart_policies or {}) - set(names)
        if unknown:
            raise ValueError(f"restart_policies name unknown children {sorted(unknown)}; children: {names}")
        self.restarts = {name: RestartHistory(policy) for name, policy in (restart_policies or {}).items()}
        self._monitor: RestartMonitor | None = None  # while running
        # held while a child is started, by restart() and by the monitor: one of them starts a dead
        # child, the other then finds it running
        self.lifecycle_lock = threading.Lock()

    # -- starting ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Starts every child in order, each once the previous one is ready. On any failure the
        children already started are stopped before the error propagates."""
        self.check_ports()
        try:
            for child in self.children.values():
                self._start_child(child)
        except BaseException as error:
            if isinstance(error, SupervisorError) and not isinstance(error, StopRequested):
                self.say(f"{str(error).partition(';')[0]}: stopping the rest")
            self.stop()
            raise
        if self.restarts:
            self._monitor = RestartMonitor(self)
            self._monitor.start()

    def check_ports(self) -> None:
        """Fails fast, before anything starts, if two children share a port or one is taken."""
        owners: dict[str, str] = {}
        for child in self.children.values():
            address = child.spec.address
            if not address:
                continue
            port = address.rpartition(":")[2]
            if port in owners:
                raise SupervisorError(f"port {port} is given to both {owners[port]} and {child.name}")
            owners[port] = child.name
            if port_in_use(address):
                raise PortInUse(child.name, address, child.spec.port_hint)

    def restart(self, name: str) -> None:
        """Starts a stopped or killed child again and waits until it is ready."""
        child = self.children[name]
        with self.lifecycle_lock:
            if child.alive:
                raise SupervisorError(f"{name} is still running (pid {child.pid})")
            child.start()
        self._say_started_then_wait_ready(child)

    def replace_spec(self, name: str, spec: ChildSpec) -> None:
        """Gives a stopped child a new spec (other flags), for restart(); the name must stay."""
        child = self.children[name]
        if child.alive or spec.name != name:
            raise SupervisorError(f"{name} must be stopped, and keep its name, to change its spec")
        self.children[name] = ChildProcess(spec, self._echo, self._echo_lock, child.tail_lines)

    def _start_child(self, child: ChildProcess) -> None:
        child.start()
        self._say_started_then_wait_ready(child)

    def _say_started_then_wait_ready(self, child: ChildProcess) -> None:
        self.say(f"started {child.name} (pid {child.pid})")
        elapsed = self._wait_ready(child)
        self.say(f"{child.name} ready at {child.spec.address or 'no address'} after {elapsed:.1f}s")

    def _wait_ready(self, child: ChildProcess) -> float:
        spec = child.spec
        grpc_probe = GrpcHealthProbe(spec.address, spec.health_service, tls=spec.tls) if spec.health_service else None
        probe: Probe = grpc_probe or spec.probe or (lambda: (True, "running"))
        started = time.monotonic()
        next_progress = started + self.progress_interval_s
        try:
            while True:
                if self.stop_requested:
                    raise StopRequested()
                self._raise_if_exited(during_startup=True)
                ready, status = probe()
                now = time.monotonic()
                if ready:
                    return now - started
                if now - started > self.startup_timeout_s:
                    raise StartupTimeout(child.name, self.startup_timeout_s, status, child.tail())
                if now >= next_progress:
                    self.say(f"waiting for {child.name} at {spec.address} ({status}): {now - started:.0f}s")
                    next_progress += self.progress_interval_s
                time.sleep(self.poll_interval_s)
        finally:
            if grpc_probe is not None:
                grpc_probe.close()

    # -- running -----------------------------------------------------------------------------------

    def check(self) -> None:
        """Raises ChildExited if a child has exited without being stopped or killed on purpose."""
        self._raise_if_exited(during_startup=False)

    def wait(self, timeout_s: float | None = None) -> None:
        """Returns when request_stop() was called (or after timeout_s); raises ChildExited if a child dies."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.stop_requested and (deadline is None or time.monotonic() < deadline):
            self.check()
            time.sleep(self.poll_interval_s)

    def request_stop(self) -> None:
        """Safe from a signal handler: start() and wait() notice within a poll interval. A second
        request while stopping skips the remaining grace periods."""
        if self.stop_requested:
            self.force_stop = True
        self.stop_requested = True

    def _raise_if_exited(self, during_startup: bool) -> None:
        for child in self.children.values():
            if self._monitor is not None and self._monitor.handles(child.name):
                continue  # a crash it restarts is not a failure
            if child.returncode is not None and not child.exit_expected:
                child.drain_output()
                child.exit_expected = True  # reported once
                raise ChildExited(child.name, child.describe_exit(), child.returncode, child.tail(), during_startup)

    # -- stopping ----------------------------------------------------------------------------------

    def stop(self) -> dict[str, int | None]:
        """Stops every child, last started first: SIGTERM, up to grace_s, then SIGKILL. Idempotent."""
        returncodes: dict[str, int | None] = {}
        if self._monitor is not None:
            self._monitor.stop()  # no restart races the shutdown
            self._monitor = None
        for child in reversed(list(self.children.values())):
            was_alive = child.alive
            returncodes[child.name] = child.stop(self.grace_s, force=lambda: self.force_stop)
            if was_alive:
                self.say(f"stopped {child.name} ({child.describe_exit()})")
        return returncodes

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> int | None:
        """Sends sig to one child and waits (up to timeout_s) for it to exit; wait()/check() do not report it."""
        return self.children[name].kill(sig, timeout_s)

    # -- facts -------------------------------------------------------------------------------------

    def address(self, name: str) -> str:
        return self.children[name].spec.address

    @property
    def addresses(self) -> dict[str, str]:
        return {name: child.spec.address for name, child in self.children.items()}

    def pid(self, name: str) -> int | None:
        return self.children[name].pid

    def tail(self, name: str) -> list[str]:
        return self.children[name].tail()

    def child_states(self) -> dict[str, ChildState]:
        """Every child's state, from any thread: what reports a crash-looping child while the rest serve."""
        now = time.monotonic()
        never = RestartState(num_restarts=0, crashes_in_window=0, crash_looping=False, last_exit="")
        states = {}
        for name, child in self.children.items():
            history = self.restarts.get(name)
            restart = history.state(now) if history is not None else never
            states[name] = ChildState(name, child.alive, child.pid, restart.num_restarts, restart.crashes_in_window,
                                      restart.crash_looping, restart.last_exit)
        return states

    def say(self, text: str) -> None:
        """A line of the supervisor's own on its echo stream (the restart monitor reports through it too)."""
        if self._echo is not None:
            with self._echo_lock:
                self._echo.write(self.own_line(text) + "\n")
                self._echo.flush()

    def own_line(self, text: str) -> str:
        """text as a line of the supervisor's own: JSON (process "tokenmill") when its children log JSON."""
        return echo_line("tokenmill", text, any(child.json_lines for child in self.children.values()))

    def __enter__(self) -> Supervisor:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def run_until_stopped(supervisor: Supervisor, on_ready=lambda: None, out: TextIO | None = None) -> int:
    """What `tokenmill serve` does: start, call on_ready(), run until SIGINT/SIGTERM (exit 0) or until a
    child without a RestartPolicy dies, or any child dies before it is first ready (exit 1), and always
    stop every child before returning, whatever went wrong. A child with a policy that keeps crashing
    is restarted (crash-looping) while the rest keep serving; the children that restarted are listed
    at the end."""
    out = out or sys.stderr
    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, lambda *_: supervisor.request_stop()) for sig in handled}
    try:
        supervisor.start()
        on_ready()
        supervisor.wait()
        print(supervisor.own_line("shutting down"), file=out, flush=True)
        return 0
    except StopRequested:
        print(supervisor.own_line("shutting down"), file=out, flush=True)
        return 0
    except SupervisorError as error:
        print(supervisor.own_line(f"error: {error}"), file=out, flush=True)
        return 1
    finally:
        supervisor.stop()  # a second Ctrl-C meanwhile skips the grace periods
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for state in supervisor.child_states().values():
            if state.restarts:
                print(supervisor.own_line(f"restarted while serving: {state.describe()}"), file=out, flush=True)
