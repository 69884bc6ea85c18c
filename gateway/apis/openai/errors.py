"""The one place that turns an exception into OpenAI's error JSON and its HTTP status.

    {"error": {"message": "invalid temperature=-1: must be a finite number in [0, 100]",
               "type": "invalid_request_error", "param": "temperature", "code": null}}

It goes through plumbing.rpc.status_for, so a core.errors exception and a downstream gRPC status
(the scheduler's RESOURCE_EXHAUSTED, say) get the same answer here as on the gRPC API.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import grpc
from aiohttp import web
from opentelemetry import trace

from core import errors
from plumbing.rpc import retry_after_of, status_for
from plumbing.telemetry import metrics
from plumbing.telemetry.span_policies import record_error

logger = logging.getLogger("tokenmill.gateway.http")

# gRPC status -> (HTTP status, OpenAI error type, error code)
_BY_STATUS: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "request_id_taken"),  # a reused X-Request-Id
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error", "cancelled"),  # nginx's "client closed request"
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", "not_implemented"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}
_INTERNAL = (500, "server_error", "internal_error")


@dataclass(frozen=True, slots=True)
class OpenAIError:
    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        headers = dict(headers or {})
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        return web.Response(status=self.status, text=json.dumps(self.body()), content_type="application/json",
                            headers=headers)


def openai_error(exc: BaseException, where: str = "") -> OpenAIError:
    """The error a client should see for exc; unexpected exceptions are logged in full."""
    if isinstance(exc, web.HTTPException):  # routing (404 unknown path, 405) and aiohttp's own limits
        type_ = "invalid_request_error" if exc.status < 500 else "server_error"
        # aiohttp's 413 text names the limit and the size sent ("Maximum request body size N exceeded, ...")
        # and our 415's text names the Content-Type sent
        reason = exc.text if exc.status in (413, 415) and exc.text else exc.reason
        return OpenAIError(exc.status, f"{reason}: {where}" if where else reason, type_)
    grpc_status, message = status_for(exc)
    metrics.count_error(grpc_status.name)
    record_error(trace.get_current_span(), exc, grpc_status.name, with_traceback=grpc_status is grpc.StatusCode.INTERNAL)
    status, type_, code = _BY_STATUS.get(grpc_status, _INTERNAL)
    if status == 500:
        logger.error("unexpected error in %s", where or "an HTTP handler", exc_info=exc)
    else:
        logger.info("%s -> %d: %s", where or "HTTP", status, message)
    param = exc.field if isinstance(exc, errors.InvalidArgument) and exc.field else None
    if isinstance(exc, errors.NotFound) and exc.kind == "model":
        code = "model_not_found"
    return OpenAIError(status, message, type_, param, code, retry_after_of(exc))
