"""One supervised child process: what to run (ChildSpec) and the running process (ChildProcess).

Each child runs in its own process group, so a Ctrl-C in the terminal reaches only the supervisor,
which then stops the children in its own order; signals go to the whole group, so anything a child
spawned goes with it. stdout and stderr are merged into one pipe that a thread drains line by line:
the lines are echoed with a "[name] " prefix (with TOKENMILL_LOG_FORMAT=json, as JSON lines with a
"process" field) and the last few are kept for the failure report.
"""
from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TextIO

from plumbing.process import EXIT_WITH_PARENT_ENV
from plumbing.telemetry.logs import echo_line, json_lines_requested
from plumbing.tls import ClientTLS

# A readiness probe answers (ready, what it saw), e.g. (False, "NOT_SERVING"); it must not raise.
Probe = Callable[[], tuple[bool, str]]

# Progress bars (tqdm) rewrite one line with "\r"; echoing each rewrite would flood the terminal.
_PROGRESS_ECHO_INTERVAL_S = 2.0


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """A process the supervisor starts, and how it knows the process is ready."""

    name: str  # "worker"; the output prefix and the name in every message
    argv: Sequence[str]
    health_service: str | None  # grpc.health.v1 service that turns SERVING when ready
    address: str  # "host:port" it listens on ("" if none): checked free before start, probed, printed
    probe: Probe | None = None  # readiness for children without gRPC health (redis PING)
    port_hint: str = ""  # how a user changes the port, e.g. "--worker-port", named when it is taken
    env: Mapping[str, str] | None = None  # extra environment variables on top of ours
    # run in a fresh temp dir (the cwd), kept across restarts after a crash, removed when the child is stopped
    use_temp_dir: bool = False
    # name -> text written (mode 0600) into the temp dir before start: secrets that must not be in argv
    files: Mapping[str, str] | None = None
    tls: ClientTLS | None = None  # how the supervisor's health probe connects when the child serves TLS


class ChildProcess:
    def __init__(self, spec: ChildSpec, echo: TextIO | None, echo_lock: threading.Lock, tail_lines: int) -> None:
        self.spec = spec
        self.name = spec.name
        self._echo = echo
        self._echo_lock = echo_lock
        self.tail_lines = tail_lines  # how many of its last output lines are kept for error messages
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._process: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._temp_dir: str | None = None
        self.exit_expected = False  # set when we stopped or killed it on purpose
        # its output is JSON lines (TOKENMILL_LOG_FORMAT=json in the environment it gets): echoed as JSON
        self.json_lines = json_lines_requested({**os.environ, **(spec.env or {})})

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        assert not self.alive, f"{self.name} is already running"
        cwd = None
        if self.spec.use_temp_dir and self._temp_dir is not None:
            cwd = self._temp_dir  # restarted after a crash: what it saved there (Redis's AOF) is still there
        elif self.spec.use_temp_dir:
            self._temp_dir = cwd = tempfile.mkdtemp(prefix=f"tokenmill-{self.name}-")
            for name, text in (self.spec.files or {}).items():
                descriptor = os.open(os.path.join(cwd, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(descriptor, "w") as file:
                    file.write(text)
        # EXIT_WITH_PARENT_ENV: a tokenmill child stops by itself if this process dies without stopping it
        env = {**os.environ, "PYTHONUNBUFFERED": "1", EXIT_WITH_PARENT_ENV: "1", **(self.spec.env or {})}
        self._process = subprocess.Popen(
            list(self.spec.argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            cwd=cwd, env=env, process_group=0)
        # only now: until the new process is recorded, returncode is the old one's, and a restart
        # monitor looking in between would take that stopped process for a crash
        self.exit_expected = False
        self._reader = threading.Thread(target=self._pump_output, name=f"output-{self.name}", daemon=True)
        self._reader.start()

    def send_signal(self, sig: int) -> None:
        # poll() first: once reaped, the pid (and group id) may belong to someone else
        if self._process is None or self._process.poll() is not None:
            return
        try:
            os.killpg(self._process.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float, force: Callable[[], bool] = lambda: False) -> int | None:
        """SIGTERM, up to grace_s for it to exit (cut short when force() turns true), then SIGKILL."""
        if self._process is None:
            return None
        self.exit_expected = True
        self.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self._process.poll() is None and time.monotonic() < deadline and not force():
            time.sleep(0.05)
        if self._process.poll() is None:
            self._say(f"{self.name} still running {grace_s:g}s after SIGTERM: sending SIGKILL")
            self.send_signal(signal.SIGKILL)
        returncode = self._process.wait()
        self.drain_output()
        self._remove_temp_dir()
        return returncode

    def kill(self, sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> int | None:
        """Signals it and waits for it to exit (for tests that break one component on purpose)."""
        if self._process is None:
            return None
        self.exit_expected = True
        self.send_signal(sig)
        returncode = self._process.wait(timeout_s)
        self.drain_output()
        return returncode

    def drain_output(self, timeout_s: float = 2.0) -> None:
        """Waits for the reader to see end of output, so the tail holds the child's last words."""
        if self._reader is not None:
            self._reader.join(timeout_s)

    def _remove_temp_dir(self) -> None:
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    # -- state -------------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.poll()

    def describe_exit(self) -> str:
        """'exited with code 3' or 'was killed by signal 9 (SIGKILL)'."""
        code = self.returncode
        if code is None:
            return "is still running"
        if code < 0:
            try:
                signal_name = signal.Signals(-code).name
            except ValueError:
                signal_name = "unknown signal"
            return f"was killed by signal {-code} ({signal_name})"
        return f"exited with code {code}"

    def tail(self) -> list[str]:
        return list(self._tail)

    # -- output ------------------------------------------------------------------------------------

    def _pump_output(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        stream = self._process.stdout
        pending = b""
        last_progress_echo = 0.0
        while chunk := stream.read1(65536):
            pending += chunk
            while True:
                cut = min((i for i in (pending.find(b"\n"), pending.find(b"\r")) if i >= 0), default=-1)
                if cut < 0:
                    break
                line, terminator, pending = pending[:cut], pending[cut:cut + 1], pending[cut + 1:]
                text = line.decode("utf-8", errors="replace").rstrip()
                if not text:
                    continue
                if terminator == b"\r":  # a progress bar redrawing itself
                    now = time.monotonic()
                    if now - last_progress_echo < _PROGRESS_ECHO_INTERVAL_S:
                        continue
                    last_progress_echo = now
                self._line(text)
        if pending.strip():
            self._line(pending.decode("utf-8", errors="replace").rstrip())
        stream.close()

    def _line(self, text: str) -> None:
        self._tail.append(text)
        if self._echo is not None:
            with self._echo_lock:
                self._echo.write(echo_line(self.name, text, self.json_lines) + "\n")
                self._echo.flush()

    def _say(self, text: str) -> None:
        if self._echo is not None:
            with self._echo_lock:
                self._echo.write(echo_line("tokenmill", text, self.json_lines) + "\n")
                self._echo.flush()
