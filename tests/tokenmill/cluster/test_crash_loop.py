"""A child that keeps crashing (more than max_restarts in the window) is restarted at the capped backoff
and reported as crash-looping, while the healthy children keep serving and the supervisor keeps
running: one request that crashes the gateway in a loop must not take the workers down. Real children:
a gRPC stand-in (tests/tokenmill/cluster/standin_child.py) as the healthy one, and a `python -c` script that
exits with code 5 at every start once a file exists as the crashing one (it starts in tens of ms, so
a loop is quick)."""
from __future__ import annotations

import io
import sys
import threading
import time

import pytest

from tests.tokenmill.cluster.test_supervisor import standin
from tokenmill.cluster.readiness import GrpcHealthProbe
from tokenmill.cluster.restart_policy import RestartPolicy
from tokenmill.cluster.supervisor import ChildExited, ChildSpec, Supervisor, run_until_stopped

# crashes at most 0.05 s apart plus a python start-up: three within the window on a loaded machine too
LOOP = RestartPolicy(backoff_initial_s=0.01, backoff_max_s=0.05, max_restarts=2, window_s=30)
CRASH_ONCE_FILE_EXISTS = """
import os, sys, time
while not os.path.exists(sys.argv[1]):
    time.sleep(0.01)
print("hostile request: crashing", flush=True)
sys.exit(5)
"""


def crash_looping_gateway_and_healthy_worker(tmp_path, policy: RestartPolicy = LOOP):
    """A supervisor whose gateway exits with code 5 at every start once the returned file exists."""
    trigger = tmp_path / "crash"
    gateway = ChildSpec("gateway", [sys.executable, "-c", CRASH_ONCE_FILE_EXISTS, str(trigger)], None, "")
    specs = [standin("worker"), gateway]
    echo = io.StringIO()
    supervisor = Supervisor(specs, echo=echo, poll_interval_s=0.02,
                            restart_policies={"worker": policy, "gateway": policy})
    return supervisor, trigger, echo


def wait_for(condition, supervisor: Supervisor, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, supervisor.child_states()
        supervisor.wait(timeout_s=0.05)  # raises ChildExited if a crash were reported


def test_a_crash_looping_child_is_restarted_and_reported_while_the_healthy_one_keeps_serving(tmp_path):
    supervisor, trigger, echo = crash_looping_gateway_and_healthy_worker(tmp_path)
    with supervisor:
        worker_pid = supervisor.pid("worker")
        trigger.touch()
        # the old code gave the gateway up after max_restarts: ChildExited here, and serve stopped everything
        wait_for(lambda: supervisor.child_states()["gateway"].restarts >= LOOP.max_restarts + 2, supervisor)
        gateway = supervisor.child_states()["gateway"]
        assert gateway.crash_looping and gateway.crashes_in_window > LOOP.max_restarts
        assert gateway.last_exit == "exited with code 5"
        worker = supervisor.child_states()["worker"]
        assert (worker.alive, worker.pid, worker.restarts, worker.crash_looping) == (True, worker_pid, 0, False)
        probe = GrpcHealthProbe(supervisor.address("worker"), "test.worker")
        try:
            assert probe() == (True, "SERVING")
        finally:
            probe.close()
        supervisor.check()
    output = echo.getvalue()
    assert "gateway is crash-looping (3 crashes in 30s): restarting it every 0.05s; " \
           "the other children keep serving" in output
    assert "gateway exited with code 5: restarting in " in output and "(restart 4, crash-looping)" in output
    assert "[gateway] hostile request: crashing" in output and "giving up" not in output


def test_a_crash_looping_child_that_stops_crashing_is_reported_recovered(tmp_path):
    policy = RestartPolicy(backoff_initial_s=0.01, backoff_max_s=0.05, max_restarts=2, window_s=1.5)
    supervisor, trigger, echo = crash_looping_gateway_and_healthy_worker(tmp_path, policy)
    with supervisor:
        trigger.touch()
        wait_for(lambda: supervisor.child_states()["gateway"].crash_looping, supervisor)
        trigger.unlink()  # the next start stays up
        wait_for(lambda: not supervisor.child_states()["gateway"].crash_looping, supervisor)
        assert supervisor.children["gateway"].alive
    assert "gateway recovered: no crash in 1.5s" in echo.getvalue()


def test_serve_keeps_running_through_a_crash_loop_and_lists_the_child_when_it_ends(tmp_path):
    """run_until_stopped (what `tokenmill serve` runs): no exit while the gateway crash-loops; the
    ordinary stop exits 0 and names the crash-looping child."""
    supervisor, trigger, echo = crash_looping_gateway_and_healthy_worker(tmp_path)

    def stop_once_crash_looping() -> None:
        deadline = time.monotonic() + 30
        while not supervisor.child_states()["gateway"].crash_looping and time.monotonic() < deadline:
            time.sleep(0.02)
        stopped_alive.append(supervisor.children["worker"].alive)
        supervisor.request_stop()

    stopped_alive: list[bool] = []
    stopper = threading.Thread(target=stop_once_crash_looping)
    assert run_until_stopped(supervisor, on_ready=lambda: (trigger.touch(), stopper.start()), out=echo) == 0
    stopper.join()
    assert stopped_alive == [True]
    output = echo.getvalue()
    assert "error:" not in output and "shutting down" in output
    assert "restarted while serving: gateway: " in output and ", crash-looping (" in output
    assert "last exited with code 5" in output and "restarted while serving: worker" not in output


def test_a_child_that_dies_before_its_first_ready_still_ends_start_despite_its_restart_policy(tmp_path):
    """The one exception, a configuration error (a missing model file, a taken port): restarting
    cannot fix it, so start() stops what it started and names the child with its output."""
    specs = [standin("worker"), standin("gateway", "--ready-after", "60", "--exit-after", "0.3",
                                        "--say", "cannot bind 0.0.0.0:50051")]
    supervisor = Supervisor(specs, echo=io.StringIO(), restart_policies={"worker": LOOP, "gateway": LOOP})
    with pytest.raises(ChildExited) as raised:
        supervisor.start()
    assert (raised.value.name, raised.value.during_startup) == ("gateway", True)
    assert "cannot bind 0.0.0.0:50051" in str(raised.value)
    assert not supervisor.children["worker"].alive


def test_the_supervisor_metrics_report_the_crash_looping_child(tmp_path):
    """tokenmill serve's own /metrics (--supervisor-metrics-port): the looping child's flag and restarts,
    the healthy one up, scraped over HTTP while the loop goes on."""
    import urllib.request

    from tokenmill.cluster.supervisor_metrics import serve_supervisor_metrics

    supervisor, trigger, _ = crash_looping_gateway_and_healthy_worker(tmp_path)
    with supervisor:
        server = serve_supervisor_metrics(supervisor, "127.0.0.1", 0)
        try:
            trigger.touch()
            wait_for(lambda: supervisor.child_states()["gateway"].crash_looping, supervisor)
            with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10) as response:
                lines = response.read().decode().splitlines()
        finally:
            server.shutdown()
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("tokenmill:")}
    assert samples['tokenmill:child_crash_looping{child="gateway"}'] == 1.0
    assert samples['tokenmill:child_restarts_total{child="gateway"}'] > LOOP.max_restarts
    assert samples['tokenmill:child_crash_looping{child="worker"}'] == 0.0
    assert samples['tokenmill:child_up{child="worker"}'] == 1.0
