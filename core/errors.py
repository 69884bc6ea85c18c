"""Failures a client can cause or must be told about, as plain exceptions.

Domain code (gateway validation, the scheduler, the worker) raises these without knowing about gRPC;
plumbing.rpc maps each class to one gRPC status code at the edge. Messages are written for the
person reading the client's error: they name the field, the value and the limit.

An error that must outlive its process (a request's ending written to Redis and read back by another
gateway) travels as its ErrorCode's name plus its message, and error_from_code rebuilds it: nobody
ever compares message text to learn what kind of failure it was.
"""
from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    """The kind of a ServingError; the names are gRPC's status names, so they read the same everywhere."""

    INVALID_ARGUMENT = enum.auto()
    NOT_FOUND = enum.auto()
    ALREADY_EXISTS = enum.auto()
    RESOURCE_EXHAUSTED = enum.auto()
    UNAVAILABLE = enum.auto()
    DEADLINE_EXCEEDED = enum.auto()
    CANCELLED = enum.auto()
    UNAUTHENTICATED = enum.auto()
    FAILED_PRECONDITION = enum.auto()
    INTERNAL = enum.auto()
    PERMISSION_DENIED = enum.auto()

# Long values (a whole prompt, a token list) are cut in messages so a status stays readable.
_MAX_VALUE_REPR = 120


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_VALUE_REPR else f"{text[:_MAX_VALUE_REPR]}... ({len(text)} chars)"


class ServingError(Exception):
    """Base class; str(error) is the message the client sees."""

    code = ErrorCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(ServingError):
    """A request field is out of range or malformed (INVALID_ARGUMENT)."""

    code = ErrorCode.INVALID_ARGUMENT

    def __init__(self, field: str, value: object, limit_or_reason: str) -> None:
        self.field = field
        self.value = value
        self.limit_or_reason = limit_or_reason
        super().__init__(f"invalid {field}={_short_repr(value)}: {limit_or_reason}")


class _AboutOneThing(ServingError):
    """An error about one thing the client named: its kind ("request", "model") and its key; detail, when
    given, says after a semicolon what the client can use instead."""

    _says = ""  # what is wrong with it, after "<kind> <key> "

    def __init__(self, kind: str, key: object, detail: str = "") -> None:
        self.kind = kind
        self.key = key
        super().__init__(f"{kind} {_short_repr(key)} {self._says}" + (f"; {detail}" if detail else ""))


class NotFound(_AboutOneThing):
    """Something named by the client does not exist, e.g. an unknown request id (NOT_FOUND)."""

    code = ErrorCode.NOT_FOUND
    _says = "not found"


class AlreadyExists(_AboutOneThing):
    """A client-chosen id is already taken by a live request (ALREADY_EXISTS)."""

    code = ErrorCode.ALREADY_EXISTS
    _says = "is already queued or running"


class UnknownModel(NotFound):
    """A model this server does not serve (NOT_FOUND, as vLLM and OpenAI answer): the message names the
    model it serves, and hint how the client's API lists it or its other names."""

    def __init__(self, model: object, served: str, hint: str = "") -> None:
        super().__init__("model", model, f"this server serves {served!r}{hint}")


class ResourceExhausted(ServingError):
    """A rate limit, a full queue or a prompt that can never fit in the KV cache (RESOURCE_EXHAUSTED).

    retry_after_s, when known, reaches the client as the trailing metadata "retry-after-ms".
    """

    code = ErrorCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(ServingError):
    """No backend can take the request right now: not ready, shutting down, circuit open (UNAVAILABLE)."""

    code = ErrorCode.UNAVAILABLE


class DeadlineExceeded(ServingError):
    """The request's deadline passed before it finished (DEADLINE_EXCEEDED)."""

    code = ErrorCode.DEADLINE_EXCEEDED


class Cancelled(ServingError):
    """The request was cancelled by its client or by an abort (CANCELLED)."""

    code = ErrorCode.CANCELLED


class Unauthenticated(ServingError):
    """Missing or wrong credentials (UNAUTHENTICATED)."""

    code = ErrorCode.UNAUTHENTICATED


class PermissionDenied(ServingError):
    """The caller is authenticated but its role may not do this, e.g. a client certificate that does
    not name the gateway role calling the scheduler (PERMISSION_DENIED)."""

    code = ErrorCode.PERMISSION_DENIED


class FailedPrecondition(ServingError):
    """The call disagrees with the server's state, e.g. a step plan naming a request the worker
    does not hold (FAILED_PRECONDITION)."""

    code = ErrorCode.FAILED_PRECONDITION


class WorkerUnavailable(Unavailable):
    """The worker running the request died or broke and the request could not be recovered
    (UNAVAILABLE). A separate class so the scheduler's outputs say which failure it was by type."""


class DrainTimeout(Unavailable):
    """The server was shutting down (SIGTERM) and its drain timeout passed before the request finished
    (UNAVAILABLE); a resumable request runs on where it is re-admitted."""


def error_from_code(code: ErrorCode, message: str) -> ServingError:
    """The error read back from storage: the class of its kind, carrying the stored message as is
    (the subclasses' constructors build messages from fields, which storage does not keep)."""
    error = ServingError.__new__(_BY_CODE.get(code, ServingError))
    ServingError.__init__(error, message)
    return error


_BY_CODE: dict[ErrorCode, type[ServingError]] = {
    cls.code: cls for cls in (InvalidArgument, NotFound, AlreadyExists, ResourceExhausted, Unavailable,
                              DeadlineExceeded, Cancelled, Unauthenticated, FailedPrecondition, PermissionDenied)
}
