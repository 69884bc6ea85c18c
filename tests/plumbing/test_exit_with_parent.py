"""A supervised child stops by itself when its supervisor dies without stopping it (SIGKILL, a crash): with
TOKENMILL_EXIT_WITH_PARENT=1, which the supervisor puts in its children's environment, wait_for_stop_signal
returns once the process that started it is gone, and the service shuts down as on SIGTERM. Real processes:
a parent that starts two children (one with the variable, one without), killed with -9."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from plumbing.process import EXIT_WITH_PARENT_ENV
from tokenmill.cluster.child_process import ChildProcess, ChildSpec

ROOT = Path(__file__).resolve().parents[2]
CHILD = textwrap.dedent("""
    import asyncio, sys
    from plumbing.process import run_process, wait_for_stop_signal

    async def main():
        print("up", flush=True)
        await wait_for_stop_signal()
        sys.stdout.write("stopped\\n")
        sys.stdout.flush()

    run_process(main())
""")
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    watched = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={**os.environ, sys.argv[2]: "1"},
                               stdout=open(sys.argv[3], "w"))
    unwatched = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env={k: v for k, v in os.environ.items()
                                                                           if k != sys.argv[2]})
    print(watched.pid, unwatched.pid, flush=True)
    time.sleep(600)
""")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit may wait for a reaper that never comes in a container)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_a_child_told_to_exit_with_its_parent_stops_when_the_parent_is_killed(tmp_path):
    log = tmp_path / "watched.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, EXIT_WITH_PARENT_ENV, str(log)], env=env,
                              stdout=subprocess.PIPE, text=True)
    watched, unwatched = map(int, parent.stdout.readline().split())
    try:
        deadline = time.monotonic() + 60
        while "up" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _running(watched) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(watched), "the watched child outlived its parent by 10 s"
        assert log.read_text().split() == ["up", "stopped"], "it stopped through its shutdown, not killed"
        assert _running(unwatched), "without the variable a process outlives its parent, as a hand-started one must"
    finally:
        for pid in (watched, unwatched):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_supervisor_tells_its_children():
    code = f"import os; print(os.environ.get({EXIT_WITH_PARENT_ENV!r}))"
    child = ChildProcess(ChildSpec("probe", [sys.executable, "-c", code], health_service=None, address=""),
                         echo=None, echo_lock=threading.Lock(), tail_lines=5)
    child.start()
    child.drain_output(timeout_s=30)
    assert child.tail()[-1] == "1"
    child.stop(grace_s=10)
