"""`tokenmill serve` output stays JSON lines with TOKENMILL_LOG_FORMAT=json: the supervisor echoes each
child's lines with the process name as a field (not a "[name] " prefix), wraps a child's non-JSON
output (redis-server's, a traceback) as a message, and writes its own lines the same way."""
from __future__ import annotations

import io
import json
import sys
import time

from tokenmill.cluster.child_process import ChildProcess, ChildSpec
from tokenmill.cluster.supervisor import Supervisor

CHILD = """
import logging
from plumbing.telemetry.logs import configure_logging
configure_logging("json")
logging.getLogger("tokenmill.test").error("request failed", extra={"request_id": "r-9"})
print("a line that is not JSON", flush=True)
"""


def echoed(json_format: str) -> list[str]:
    out = io.StringIO()
    spec = ChildSpec(name="chatty", argv=[sys.executable, "-c", CHILD], health_service=None, address="",
                     env={"TOKENMILL_LOG_FORMAT": json_format, "PYTHONPATH": "."})
    supervisor = Supervisor([spec], echo=out)
    child: ChildProcess = supervisor.children["chatty"]
    child.start()
    deadline = time.monotonic() + 60
    while child.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    child.drain_output()
    supervisor.say("shutting down")
    return out.getvalue().splitlines()


def test_json_children_are_echoed_as_json_lines_with_the_process_name():
    lines = [json.loads(line) for line in echoed("json")]  # every line parses
    error = next(entry for entry in lines if entry.get("message") == "request failed")
    assert error["process"] == "chatty" and error["level"] == "ERROR" and error["request_id"] == "r-9"
    plain = next(entry for entry in lines if entry.get("message") == "a line that is not JSON")
    assert plain["process"] == "chatty" and plain["level"] == "INFO" and plain["time"].endswith("Z")
    assert lines[-1]["process"] == "tokenmill" and lines[-1]["message"] == "shutting down"


def test_text_children_keep_the_prefix():
    lines = echoed("text")
    assert "[chatty] a line that is not JSON" in lines and lines[-1] == "[tokenmill] shutting down"
