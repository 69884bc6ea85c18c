"""The supervisor against real child processes: stand-in gRPC children (tests/tokenmill/cluster/standin_child.py)
whose readiness flips or which fail on cue, and a real redis-server."""
from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from tokenmill.cluster.readiness import free_port, redis_ping_probe
from tokenmill.cluster.redis_process import redis_spec
from tokenmill.cluster.supervisor import (ChildExited, ChildSpec, PortInUse, StartupTimeout, Supervisor, SupervisorError,
                                  run_until_stopped)

STANDIN = Path(__file__).with_name("standin_child.py")
REPO_ROOT = Path(__file__).resolve().parents[3]


def standin(name: str, *flags: str, port: int | None = None) -> ChildSpec:
    port = port or free_port()
    service = f"test.{name}"
    argv = [sys.executable, str(STANDIN), "--port", str(port), "--service", service, *flags]
    return ChildSpec(name, argv, service, f"127.0.0.1:{port}", port_hint=f"--{name}-port")


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # our own children are reaped by Popen.wait; a zombie would still answer kill(0)
    return False


def stamp(supervisor: Supervisor, name: str, word: str) -> float:
    return float(next(line.split()[1] for line in supervisor.tail(name) if line.startswith(word + " ")))


@pytest.fixture
def echo() -> io.StringIO:
    return io.StringIO()


def test_children_start_in_order_each_once_the_previous_is_ready(echo):
    specs = [standin(name, "--ready-after", "0.6") for name in ("first", "second", "third")]
    supervisor = Supervisor(specs, echo=echo, progress_interval_s=0.2)
    with supervisor:
        assert supervisor.addresses == {spec.name: spec.address for spec in specs}
        assert stamp(supervisor, "second", "started") >= stamp(supervisor, "first", "ready")
        assert stamp(supervisor, "third", "started") >= stamp(supervisor, "second", "ready")
        pids = [supervisor.pid(name) for name in ("first", "second", "third")]
        supervisor.check()  # nothing died
    output = echo.getvalue()
    assert "[first] started " in output  # children's output passes through with a prefix
    assert "[tokenmill] waiting for first at 127.0.0.1:" in output and "NOT_SERVING" in output
    stops = [output.index(f"stopped {name}") for name in ("third", "second", "first")]
    assert stops == sorted(stops), "children must stop in reverse start order"
    assert "[third] got SIGTERM, stopping" in output
    assert all(pid_gone(pid) for pid in pids)


def test_child_that_dies_during_startup_is_named_with_its_code_and_output_and_the_rest_stop(echo):
    specs = [standin("first"),
             standin("second", "--ready-after", "60", "--exit-after", "0.3", "--exit-code", "3",
                     "--say", "cannot open /models/missing.gguf"),
             standin("third")]
    supervisor = Supervisor(specs, echo=echo)
    with pytest.raises(ChildExited) as raised:
        supervisor.start()
    error = raised.value
    assert (error.name, error.returncode, error.during_startup) == ("second", 3, True)
    assert "second exited with code 3 during startup" in str(error)
    assert "cannot open /models/missing.gguf" in str(error) and "giving up with code 3" in str(error)
    assert "second exited with code 3 during startup: stopping the rest" in echo.getvalue()
    assert pid_gone(supervisor.pid("first"))
    assert supervisor.pid("third") is None, "nothing starts after a failure"


def test_child_killed_after_startup_is_reported_with_its_signal(echo):
    supervisor = Supervisor([standin("first"), standin("second")], echo=echo)
    with supervisor:
        os.kill(supervisor.pid("first"), signal.SIGKILL)
        with pytest.raises(ChildExited, match=r"first was killed by signal 9 \(SIGKILL\) unexpectedly"):
            supervisor.wait(timeout_s=10)
        second = supervisor.pid("second")
    assert pid_gone(second)


def test_kill_on_purpose_is_not_a_failure_and_the_child_can_be_restarted(echo):
    with Supervisor([standin("worker")], echo=echo) as supervisor:
        old_pid = supervisor.pid("worker")
        assert supervisor.kill("worker") == -signal.SIGKILL
        supervisor.wait(timeout_s=0.3)  # does not raise
        supervisor.restart("worker")
        assert supervisor.pid("worker") != old_pid and supervisor.children["worker"].alive
    assert pid_gone(old_pid)


def test_child_ignoring_sigterm_is_killed_after_the_grace_period(echo):
    supervisor = Supervisor([standin("stubborn", "--ignore-sigterm")], echo=echo, grace_s=0.5)
    supervisor.start()
    started = time.monotonic()
    assert supervisor.stop() == {"stubborn": -signal.SIGKILL}
    assert time.monotonic() - started >= 0.5
    assert "still running 0.5s after SIGTERM: sending SIGKILL" in echo.getvalue()


def test_child_that_never_becomes_ready_times_out_with_what_it_last_said(echo):
    supervisor = Supervisor([standin("slow", "--ready-after", "60", "--say", "loading layer 7")], echo=echo,
                            startup_timeout_s=3)  # long enough for it to be listening, under load too
    with pytest.raises(StartupTimeout, match=r"slow not ready after 3s \(last seen: NOT_SERVING\)") as raised:
        supervisor.start()
    assert "loading layer 7" in str(raised.value)
    assert pid_gone(supervisor.pid("slow"))


def test_port_in_use_is_named_with_the_flag_to_change_it_and_nothing_starts(echo):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        supervisor = Supervisor([standin("worker"), standin("gateway", port=port)], echo=echo)
        with pytest.raises(PortInUse, match=f"port {port} for gateway is already in use on 127.0.0.1; "
                                            "change it with --gateway-port"):
            supervisor.start()
    assert supervisor.pid("worker") is None


def test_two_children_on_one_port_are_refused():
    port = free_port()
    with pytest.raises(SupervisorError, match=f"port {port} is given to both a and b"):
        Supervisor([standin("a", port=port), standin("b", port=port)], echo=False).start()


def test_real_redis_server_answers_ping_and_is_stopped_with_its_temp_dir(echo):
    port = free_port()
    supervisor = Supervisor([redis_spec(port)], echo=echo)
    with supervisor:
        with redis.Redis(host="127.0.0.1", port=port) as client:
            assert client.ping()
            client.set("tokenmill:probe", "1")
        temp_dir = supervisor.children["redis"]._temp_dir
        assert temp_dir and os.path.isdir(temp_dir)
        pid = supervisor.pid("redis")
    assert pid_gone(pid)
    assert redis_ping_probe("127.0.0.1", port) == (False, "not answering yet")
    assert not os.path.exists(temp_dir)


def test_run_until_stopped_exits_nonzero_when_a_child_dies_after_ready(echo, tmp_path):
    trigger = tmp_path / "fail-now"
    spec = standin("worker", "--exit-when", str(trigger), "--exit-code", "7")
    supervisor = Supervisor([spec, standin("gateway")], echo=echo)
    assert run_until_stopped(supervisor, on_ready=trigger.touch, out=echo) == 1
    assert trigger.exists()  # on_ready ran: the failure came after startup
    assert "error: worker exited with code 7 unexpectedly" in echo.getvalue()
    assert pid_gone(supervisor.pid("gateway"))


# A supervisor in a process of its own, as `tokenmill serve` runs: redis-server plus two stand-ins.
DRIVER = textwrap.dedent("""
    import json, sys
    from tokenmill.cluster.redis_process import redis_spec
    from tokenmill.cluster.supervisor import ChildSpec, Supervisor, run_until_stopped
    specs = [redis_spec(int(sys.argv[1]))] + [ChildSpec(**spec) for spec in json.loads(sys.argv[2])]
    supervisor = Supervisor(specs, grace_s=5)
    def on_ready():
        print("READY", json.dumps({name: supervisor.pid(name) for name in supervisor.children}), flush=True)
    sys.exit(run_until_stopped(supervisor, on_ready))
""")


def test_sigterm_to_the_supervisor_process_stops_every_child():
    redis_port = free_port()
    standins = [standin("worker"), standin("gateway")]
    specs_json = json.dumps([{"name": s.name, "argv": list(s.argv), "health_service": s.health_service,
                              "address": s.address} for s in standins])
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(redis_port), specs_json], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = driver.stdout.readline()
        assert line.startswith("READY "), driver.stderr.read() if driver.poll() is not None else line
        pids = json.loads(line.split(" ", 1)[1])
        assert set(pids) == {"redis", "worker", "gateway"}
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=20) == 0
    finally:
        if driver.poll() is None:
            driver.kill()
    log = driver.stderr.read()
    assert "[tokenmill] shutting down" in log and "[gateway] got SIGTERM, stopping" in log
    assert all(pid_gone(pid) for pid in pids.values()), log
    assert redis_ping_probe("127.0.0.1", redis_port)[0] is False
