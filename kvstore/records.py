"""The request record kept in Redis: one hash per request, `tokenmill:req:{request_id}`.

The record is bookkeeping for operators and for clients asking "what happened to my request"; the
scheduler's own `Request` stays the source of truth while a request is alive.
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from core.errors import ErrorCode
from core.outputs import FinishReason

RECORD_KEY_PREFIX = "tokenmill:req:"


class RecordStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


# Terminal is an explicit set: once a record reaches one of these, nothing changes it again.
TERMINAL_STATUSES = frozenset({RecordStatus.FINISHED, RecordStatus.FAILED, RecordStatus.CANCELLED})

# running -> queued is a preemption (the request goes back to the queue for recompute) and is the
# only transition that counts: the server adds one to num_preemptions for each. The Lua script in
# kvstore.record_update is generated from this table, so it is the one place the rule lives.
ALLOWED_TRANSITIONS: dict[RecordStatus, frozenset[RecordStatus]] = {
    RecordStatus.QUEUED: frozenset(
        {RecordStatus.RUNNING, RecordStatus.CANCELLED, RecordStatus.FAILED}
    ),
    RecordStatus.RUNNING: frozenset(
        {RecordStatus.QUEUED, RecordStatus.FINISHED, RecordStatus.FAILED, RecordStatus.CANCELLED}
    ),
    RecordStatus.FINISHED: frozenset(),
    RecordStatus.FAILED: frozenset(),
    RecordStatus.CANCELLED: frozenset(),
}

# Fields a writer may set, with how each is stored (everything in a Redis hash is a string).
# status goes through the transition check and num_preemptions is only ever counted by the server,
# so neither is in here.
FIELD_TYPES: dict[str, type] = {
    "num_prompt_tokens": int,
    "num_output_tokens": int,
    "created_at": float,
    "first_scheduled_at": float,
    "first_token_at": float,
    "finished_at": float,
    "finish_reason": FinishReason,  # stored as the enum's name ("STOP", "LENGTH", ...)
    "error": str,  # the message
    "error_code": ErrorCode,  # the kind of failure, stored as the enum's name ("DEADLINE_EXCEEDED", ...)
    "model": str,
    "priority": int,
    "owner": str,  # API key name that submitted it (gateway checks on status / cancel / resume)
}

# Set once: a later write (a re-queue after preemption, a retried batch) must not move them.
FIRST_WRITE_WINS = frozenset({"created_at", "first_scheduled_at", "first_token_at", "owner"})


def record_key(request_id: str) -> str:
    return RECORD_KEY_PREFIX + request_id


def encode_field(name: str, value: object) -> str:
    """The hash value for `name`; raises ValueError naming the field and value if it does not fit."""
    field_type = FIELD_TYPES.get(name)
    value_type = type(value)
    # exact-type checks first: this runs for every state event the scheduler emits
    if field_type is float and (value_type is float or value_type is int):
        return repr(float(value))  # repr round-trips a float exactly
    if field_type is value_type:
        return value.name if isinstance(value, enum.Enum) else value if value_type is str else str(value)
    if field_type is None:
        raise ValueError(f"unknown record field {name!r}; settable fields: {sorted(FIELD_TYPES)}")
    if field_type is int and isinstance(value, int) and not isinstance(value, bool):
        return str(int(value))  # an int subclass such as IntEnum
    if field_type is str and isinstance(value, str):
        return str(value)
    if isinstance(field_type, enum.EnumMeta):
        raise ValueError(f"record field {name!r} must be a {field_type.__name__}, got {value!r}")
    kind = {int: "an int", float: "unix seconds (float)", str: "a str"}[field_type]
    raise ValueError(f"record field {name!r} must be {kind}, got {value!r}")


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    status: RecordStatus
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    created_at: float | None = None  # unix seconds, like every *_at below
    first_scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: ErrorCode | None = None
    model: str | None = None
    priority: int = 0
    owner: str | None = None  # None: submitted without API keys

    @property
    def is_terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def to_mapping(self) -> dict[str, str]:
        """The hash fields; None fields are left out (absent means unknown)."""
        mapping = {
            "request_id": self.request_id,
            "status": RecordStatus(self.status).value,
            "num_preemptions": str(self.num_preemptions),
        }
        for name in FIELD_TYPES:
            value = getattr(self, name)
            if value is not None:
                mapping[name] = encode_field(name, value)
        return mapping

    @classmethod
    def from_mapping(cls, mapping: Mapping[str | bytes, str | bytes]) -> RequestRecord:
        """Parse a hash as HGETALL returns it (bytes or str); unknown fields are ignored."""
        text = {_text(k): _text(v) for k, v in mapping.items()}
        for required in ("request_id", "status"):
            if required not in text:
                raise ValueError(f"request record is missing field {required!r}: {sorted(text)}")
        values: dict[str, object] = {
            "request_id": text["request_id"],
            "status": RecordStatus(text["status"]),
            "num_preemptions": int(text.get("num_preemptions", "0")),
        }
        for name, field_type in FIELD_TYPES.items():
            if name in text:
                values[name] = _decode_field(field_type, text[name])
        return cls(**values)


def _decode_field(field_type: type, text: str) -> object:
    return field_type[text] if isinstance(field_type, enum.EnumMeta) else field_type(text)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value

