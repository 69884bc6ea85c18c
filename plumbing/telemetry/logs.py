"""Log output for tokenmill processes: plain text (default) or one JSON object per line.

TOKENMILL_LOG_FORMAT=json (read once, in plumbing.process.run_process) gives lines like

    {"time": "2026-11-29T17:01:02.345Z", "level": "INFO", "service": "gateway",
     "logger": "tokenmill.gateway.requests", "message": "request r-1 finished: length, 16 tokens",
     "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736", "span_id": "00f067aa0ba902b7", "request_id": "r-1"}

trace_id / span_id are the span current when the line was logged (absent when there is none, e.g.
tracing is off); request_id comes from `extra={"request_id": ...}` or from the request being served
(request_scope), so log collectors can join logs to traces and to a request's record.

A line may carry structured fields beside its message, `extra={"fields": {...}}` (log_fields): each
becomes a key of the JSON object (never replacing one above), so a collector filters and sums them
without parsing the text. The gateway's request-end line has

    "finish_reason": "length", "prompt_tokens": 7, "output_tokens": 16, "ttft_ms": 12.3, "e2e_ms": 80.1,
    "error_code": "DEADLINE_EXCEEDED" (errors), "finish_cause": "deadline" (where one applies)

Text mode shows the message alone.
"""
from __future__ import annotations

import contextvars
import json
import logging
import time

from opentelemetry import trace

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# the request a task is serving; set by the gateway (and scheduler) around each request's work
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
_service = ""


def bind_request(request_id: str) -> None:
    """Tags the current task's log lines with request_id (a gRPC call is a task of its own)."""
    current_request_id.set(request_id)


def log_fields(request_id: str | None = None, **fields) -> dict:
    """`extra` for a log line with structured fields (JSON mode): logger.info(..., extra=log_fields(id, a=1))."""
    extra: dict = {"fields": fields}
    if request_id:
        extra["request_id"] = request_id
    return extra


def set_service(name: str) -> None:
    global _service
    _service = name


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": _service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        span_context = trace.get_current_span().get_span_context()
        if span_context.is_valid:
            entry["trace_id"] = format(span_context.trace_id, "032x")
            entry["span_id"] = format(span_context.span_id, "016x")
        request_id = getattr(record, "request_id", None) or current_request_id.get()
        if request_id:
            entry["request_id"] = request_id
        for key, value in (getattr(record, "fields", None) or {}).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """Root logging to stderr in the given format ("text" or "json")."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {LOG_FORMATS} (TOKENMILL_LOG_FORMAT)")
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)


def echo_line(process: str, text: str, json_lines: bool) -> str:
    """One line of a child process's output as a supervisor (`tokenmill serve`) echoes it: with a
    "[process] " prefix, or with JSON logs on, as a JSON object with a "process" field, so the
    combined output stays one JSON object per line (a child's non-JSON output, e.g. redis-server's
    or a crash's traceback, becomes the "message" of a line of its own)."""
    if not json_lines:
        return f"[{process}] {text}"
    entry = None
    if text.startswith("{"):
        try:
            entry = json.loads(text)
        except ValueError:
            entry = None
    if not isinstance(entry, dict):
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "Z", "level": "INFO", "message": text}
    return json.dumps({"process": process, **entry}, ensure_ascii=False)


def json_lines_requested(environ) -> bool:
    """Whether a process started with `environ` logs JSON lines (TOKENMILL_LOG_FORMAT=json)."""
    return environ.get("TOKENMILL_LOG_FORMAT", "").strip().lower() == "json"
