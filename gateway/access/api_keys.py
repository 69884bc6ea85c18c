"""API keys: a file of hashed keys, and the check of a client's `authorization: Bearer <key>`.

The keys file (`--api-keys-file`) holds one JSON object per line; blank lines and lines starting
with # are skipped. Only the SHA-256 of each key is stored (`tokenmill hash-api-key` makes a line):

    {"name": "alice", "sha256": "9f86d08...", "requests_per_s": 5, "burst": 10}
    {"name": "batch-jobs", "sha256": "60303ae..."}          # the gateway's default rate limit
    {"name": "chat", "sha256": "2c26b46...", "target_itl_ms": 30, "target_ttft_ms": 500}

target_itl_ms / target_ttft_ms make a class of service: the gateway puts them on every request the
key submits, and the scheduler plans for them as it does for its own --target-itl-ms / --target-ttft-ms
(a step's inter-token target is the tightest among the requests it decodes; tight TTFT targets get
their prefill first). A key without them gets the scheduler's flags, as before.

    store = ApiKeyStore(load_api_keys("keys.jsonl"))
    key = store.authenticate("Bearer s3cret")    # ApiKey, or Unauthenticated naming what was wrong

Messages never repeat the key a client sent: it may be a real key sent to the wrong place.
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import string
from dataclasses import dataclass
from pathlib import Path

from core.errors import Unauthenticated
from core.requests import GenerationRequest

_TARGET_FIELDS = ("target_itl_ms", "target_ttft_ms")
_FIELDS = {"name", "sha256", "requests_per_s", "burst", *_TARGET_FIELDS}
_HINT = "send the header / metadata 'authorization: Bearer <key>'"


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str  # shown in logs and rate-limit messages; never the key itself
    sha256: str  # hex digest of the key's UTF-8 bytes
    requests_per_s: float | None = None  # None: the gateway's --rate-limit-rps
    burst: int | None = None  # None: the gateway's --rate-limit-burst
    # latency targets of the key's class of service, milliseconds; None: the scheduler's flags
    target_itl_ms: float | None = None
    target_ttft_ms: float | None = None

    def with_targets(self, request: GenerationRequest) -> GenerationRequest:
        """request carrying this key's latency targets; the same request when the key has none."""
        if self.target_itl_ms is None and self.target_ttft_ms is None:
            return request
        return dataclasses.replace(request, target_itl_ms=self.target_itl_ms, target_ttft_ms=self.target_ttft_ms)


def hash_api_key(key: str) -> str:
    """The hex SHA-256 a keys file stores for key (a key is long and random, so no salt or stretching)."""
    return hashlib.sha256(key.encode()).hexdigest()


def load_api_keys(path: str | Path) -> list[ApiKey]:
    """Parses a keys file; ValueError naming the file, the line and the field for anything wrong in it."""
    keys: list[ApiKey] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{where}: not a JSON object ({error})") from None
        keys.append(api_key_from_entry(entry, where))
    names = [key.name for key in keys]
    duplicate = next((name for name in names if names.count(name) > 1), None)
    if duplicate is not None:
        raise ValueError(f"{path}: name {duplicate!r} is used by more than one key")
    return keys


def api_key_from_entry(entry: object, where: str) -> ApiKey:
    """One parsed line of a keys file; where ("FILE:LINE") prefixes every error."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: must be a JSON object with name and sha256, not {type(entry).__name__}")
    unknown = set(entry) - _FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(_FIELDS)}")
    name, digest = entry.get("name"), entry.get("sha256")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name must be a non-empty string")
    if not isinstance(digest, str) or len(digest) != 64 or set(digest.lower()) - set(string.hexdigits):
        raise ValueError(f"{where}: sha256 must be 64 hex digits (tokenmill hash-api-key makes one)")
    rate, burst = entry.get("requests_per_s"), entry.get("burst")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0):
        raise ValueError(f"{where}: requests_per_s={rate!r} must be a number > 0")
    if burst is not None and (isinstance(burst, bool) or not isinstance(burst, int) or burst < 1):
        raise ValueError(f"{where}: burst={burst!r} must be an integer >= 1")
    targets = {}
    for field in _TARGET_FIELDS:
        value = entry.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 < value < float("inf")):
            raise ValueError(f"{where}: {field}={value!r} must be a number of milliseconds > 0")
        targets[field] = None if value is None else float(value)
    return ApiKey(name, digest.lower(), None if rate is None else float(rate), burst, **targets)


class ApiKeyStore:
    def __init__(self, keys: list[ApiKey]) -> None:
        self.keys = keys

    def authenticate(self, authorization: str | None) -> ApiKey:
        """The key named by an Authorization value ("Bearer <key>"); Unauthenticated otherwise."""
        if not authorization:
            raise Unauthenticated(f"missing API key: {_HINT}")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            # not even the scheme is echoed: a client that forgot "Bearer " sent its key there
            raise Unauthenticated(f"malformed authorization: expected the Bearer scheme; {_HINT}")
        digest = hash_api_key(key.strip()).encode()
        found = None
        for candidate in self.keys:  # every key is compared, in constant time each: no early exit to time
            if hmac.compare_digest(digest, candidate.sha256.encode()):
                found = candidate
        if found is None:
            raise Unauthenticated(f"unknown API key (it matches no key in the gateway's --api-keys-file): {_HINT}")
        return found
