"""`tokenmill serve` output stays JSON lines with TOKENMILL_LOG_FORMAT=json: the supervisor echoes each
child's lines with the process name as a field (not a "[name] " prefix), wraps a child's non-JSON
output (redis-server's, a traceback) as a message, and writes its own lines the same way. A line's
structured fields (log_fields) are keys of its JSON object: the gateway's request-end line carries the
request id, tokens, ending and durations as numbers and strings, not only inside its message."""
from __future__ import annotations

import io
import json
import logging
import sys
import time

import grpc
import pytest

from plumbing.telemetry.logs import JsonFormatter, log_fields
from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from tests.plumbing.telemetry.conftest import LONG_TOKENS, greedy_request
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


def test_structured_fields_are_keys_of_the_json_line_and_never_replace_its_own():
    record = logging.LogRecord("tokenmill.test", logging.INFO, __file__, 1, "request %s ended", ("r-1",), None)
    for key, setting in log_fields("r-1", finish_reason="stop", output_tokens=3, ttft_ms=None, level="x").items():
        setattr(record, key, setting)
    entry = json.loads(JsonFormatter().format(record))
    assert entry["request_id"] == "r-1" and entry["message"] == "request r-1 ended"
    assert entry["finish_reason"] == "stop" and entry["output_tokens"] == 3 and entry["ttft_ms"] is None
    assert entry["level"] == "INFO"  # a field named like one of the line's own keys does not replace it


@pytest.mark.slow
def test_the_request_end_line_has_structured_fields(traced_cluster):
    """Through a real gateway with TOKENMILL_LOG_FORMAT=json: the end line of a request that ran and of one
    cut by its deadline."""
    config, supervisor = traced_cluster
    with grpc.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        list(stub.GenerateStream(greedy_request("fields-1", "structured", 6), timeout=60))
        with pytest.raises(grpc.RpcError):
            list(stub.GenerateStream(generation_pb2.GenerateRequest(
                request_id="fields-2", prompt="structured",
                parameters=generation_pb2.GenerateParameters(max_tokens=LONG_TOKENS, ignore_eos=True)), timeout=1.0))
    ran, cut = end_line(supervisor, "fields-1"), end_line(supervisor, "fields-2")
    assert ran["finish_reason"] == "length" and ran["output_tokens"] == 6 and ran["prompt_tokens"] > 0
    assert 0 < ran["ttft_ms"] <= ran["e2e_ms"] and "error_code" not in ran
    assert cut["finish_reason"] == "error" and cut["error_code"] == "DEADLINE_EXCEEDED"
    assert cut["finish_cause"] == "deadline" and cut["e2e_ms"] >= 900


def end_line(supervisor, request_id: str) -> dict:
    deadline = time.monotonic() + 15
    while True:
        found = [entry for entry in (json.loads(line) for line in supervisor.tail("gateway") if line.startswith("{"))
                 if entry.get("request_id") == request_id and "ended: " in entry["message"]]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, found
            return found[0]
        time.sleep(0.1)
