"""Restart backoff and crash-looping, on hand-given times; and the supervisor restarting a real child
killed with -9 (a stand-in gRPC child, tests/tokenmill/cluster/standin_child.py). A child that keeps crashing
is never given up: tests/tokenmill/cluster/test_crash_loop.py."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import time

from tests.tokenmill.cluster.test_supervisor import pid_gone, standin
from tokenmill.cluster.restart_policy import RestartHistory, RestartPolicy, RestartState
from tokenmill.cluster.supervisor import Supervisor


def test_backoff_doubles_up_to_the_cap_then_crash_loops_at_the_cap_until_a_quiet_window():
    history = RestartHistory(RestartPolicy(backoff_initial_s=0.5, backoff_max_s=3.0, max_restarts=3, window_s=10))
    assert [history.record_crash(t) for t in (0, 1, 2)] == [0.5, 1.0, 2.0]
    assert not history.state(2).crash_looping
    # one crash past max_restarts in the window: never given up, restarted at the cap
    assert history.record_crash(3, "exited with code 1") == 3.0
    assert history.state(3) == RestartState(num_restarts=4, crashes_in_window=4, crash_looping=True,
                                            last_exit="exited with code 1")
    # while crash-looping every restart waits the cap, even once the early crashes left the window
    assert history.record_crash(12.5) == 3.0
    assert not history.recovered(20) and history.state(20).crash_looping
    # a whole window without a crash: recovered (reported once), and back to the short backoff
    assert history.recovered(22.6) and not history.recovered(22.7)
    assert not history.state(22.7).crash_looping
    assert history.record_crash(23) == 0.5


def test_a_child_killed_with_9_is_restarted_and_not_reported():
    echo = io.StringIO()
    policy = RestartPolicy(backoff_initial_s=0.1, backoff_max_s=0.2, max_restarts=1, window_s=60)
    with Supervisor([standin("worker")], echo=echo, restart_policies={"worker": policy}) as supervisor:
        first = supervisor.pid("worker")
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while supervisor.pid("worker") == first and time.monotonic() < deadline:
            supervisor.check()  # a crash it restarts is not reported
            time.sleep(0.05)
        assert supervisor.pid("worker") != first and pid_gone(first)
        state = supervisor.child_states()["worker"]
        assert (state.restarts, state.crash_looping) == (1, False)
        assert state.last_exit == "was killed by signal 9 (SIGKILL)"
    assert "restarting in 0.1s (restart 1)" in echo.getvalue()


def test_a_child_restarted_by_hand_is_not_taken_for_a_crash_while_its_process_starts(monkeypatch):
    """supervisor.kill then supervisor.restart (what a test that stops Redis does): while the new
    process is being spawned the old one's exit must still read as wanted; the monitor took it for a
    crash, started a second copy and, on a loaded machine, died on 'already running', after which no
    crash of any child was restarted (the CI failure of test_faults: a gateway killed later never came
    back). Spawning is slowed to make the window certain."""
    real_popen = subprocess.Popen

    def slow_popen(*args, **kwargs):
        time.sleep(0.5)
        return real_popen(*args, **kwargs)

    echo = io.StringIO()
    policy = RestartPolicy(backoff_initial_s=0.05, backoff_max_s=0.05, max_restarts=5, window_s=60)
    with Supervisor([standin("worker")], echo=echo, poll_interval_s=0.01,
                    restart_policies={"worker": policy}) as supervisor:
        supervisor.kill("worker")
        monkeypatch.setattr(subprocess, "Popen", slow_popen)
        supervisor.restart("worker")
        monkeypatch.setattr(subprocess, "Popen", real_popen)
        time.sleep(0.3)  # several monitor passes
        assert "restarting" not in echo.getvalue()
        assert_crash_restarted(supervisor)


def test_a_child_restarted_by_hand_during_the_backoff_is_left_running_by_the_monitor():
    echo = io.StringIO()
    policy = RestartPolicy(backoff_initial_s=1.0, backoff_max_s=1.0, max_restarts=5, window_s=60)
    with Supervisor([standin("worker")], echo=echo, poll_interval_s=0.01,
                    restart_policies={"worker": policy}) as supervisor:
        os.kill(supervisor.pid("worker"), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while "restarting in 1.0s" not in echo.getvalue() and time.monotonic() < deadline:
            time.sleep(0.01)
        supervisor.restart("worker")  # inside the monitor's second of backoff
        by_hand = supervisor.pid("worker")
        time.sleep(1.5)  # the backoff has passed: the monitor finds it running
        assert supervisor.pid("worker") == by_hand and "restarted worker" not in echo.getvalue()
        assert_crash_restarted(supervisor)


def assert_crash_restarted(supervisor: Supervisor) -> None:
    """The monitor still restarts a crash (its thread is alive)."""
    crashed = supervisor.pid("worker")
    os.kill(crashed, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while supervisor.pid("worker") == crashed and time.monotonic() < deadline:
        supervisor.check()
        time.sleep(0.05)
    assert supervisor.pid("worker") != crashed, "the crash was not restarted"
