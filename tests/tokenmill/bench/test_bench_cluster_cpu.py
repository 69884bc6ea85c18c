"""bench-cluster's per-process CPU accounting (where a cluster round's CPU time goes)."""
import subprocess
import sys
import time

from tokenmill.bench.cluster import cpu_seconds


def test_cpu_seconds_counts_a_busy_child_and_this_process():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.5\n"
                             "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while cpu_seconds({"busy": busy.pid})["busy"] < 0.45 and time.monotonic() < deadline:
            time.sleep(0.05)
        seconds = cpu_seconds({"busy": busy.pid, "gone": 2**22 + 1})
        assert 0.45 <= seconds["busy"] < 5
        assert "gone" not in seconds  # a process that is not there is left out, not counted as 0
        assert seconds["client"] > 0  # this process's own
    finally:
        busy.kill()
        busy.wait()
