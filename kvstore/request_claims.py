"""Client-chosen request ids bound to one request: `tokenmill:claim:{request_id}`.

A gateway claims the id before it submits, in one atomic step, with a fingerprint of what the
request is (owner, prompt ids, sampling parameters). Whoever comes next with the same id learns
which of three things it is:

    CLAIMED    the id was free and is now this caller's: submit the request
    SAME       the same request already holds it: attach to that one (never run it twice)
    DIFFERENT  another request holds it: ALREADY_EXISTS

so two gateway replicas racing for one id get one CLAIMED and one SAME. The value also names the
claiming attempt (a random holder) and when it claimed, so that a claim can be let go safely:

- release(): the holder's submission was refused (queue full, invalid, no scheduler). Deleted only
  if it still holds it, so a retry claims afresh instead of attaching to a request that never ran.
- abandoned(): a gateway died between claiming and submitting. An attacher that sees no record
  and no tokens for a claim older than ABANDONED_AFTER_S deletes it (compare-and-delete) and claims.

A claim lives as long as the request's record and token stream (the same TTL), so the id stays
bound while there is anything to attach to.
"""
from __future__ import annotations

import enum
import hashlib
import json
import time
import uuid
from dataclasses import asdict, dataclass

from core.requests import GenerationRequest
from kvstore.client import connect

CLAIM_KEY_PREFIX = "tokenmill:claim:"
# A holder submits within milliseconds of claiming and the scheduler writes the record a few ms
# later; a claim this old with neither record nor tokens belongs to a gateway that died in between.
ABANDONED_AFTER_S = 10.0

# KEYS[1] claim; ARGV: value, ttl. Returns the value now stored (ARGV[1] when it was free).
_CLAIM_LUA = """
local current = redis.call('GET', KEYS[1])
if current then return current end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return ARGV[1]
"""
# KEYS[1] claim; ARGV[1] the value expected. Deletes only what the caller saw.
_DELETE_IF_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def claim_key(request_id: str) -> str:
    return CLAIM_KEY_PREFIX + request_id


def request_fingerprint(owner: str | None, request: GenerationRequest) -> str:
    """What makes two submissions "the same request": the key that sent it, the prompt ids and
    every sampling parameter (stop ids, seed, ... included)."""
    body = json.dumps([owner or "", list(request.prompt_token_ids), asdict(request.sampling_params)],
                      sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(body.encode()).hexdigest()


class ClaimVerdict(enum.Enum):
    CLAIMED = "claimed"
    SAME = "same"
    DIFFERENT = "different"


@dataclass(frozen=True, slots=True)
class Claim:
    request_id: str
    verdict: ClaimVerdict
    value: str  # what the claim key holds: "fingerprint holder claimed_at"

    @property
    def claimed_at(self) -> float:
        return float(self.value.split()[2])


class RequestClaims:
    """Raises redis.exceptions.RedisError (or OSError / TimeoutError) when Redis is away."""

    def __init__(self, redis_url: str, *, ttl_s: int = 3600) -> None:
        self._client = connect(redis_url)
        self._ttl_s = ttl_s
        self._claim = self._client.register_script(_CLAIM_LUA)
        self._delete_if = self._client.register_script(_DELETE_IF_LUA)

    async def claim(self, request_id: str, fingerprint: str) -> Claim:
        value = f"{fingerprint} {uuid.uuid4().hex} {time.time():.3f}"
        stored = await self._claim(keys=[claim_key(request_id)], args=[value, self._ttl_s])
        if stored == value:
            verdict = ClaimVerdict.CLAIMED
        else:
            verdict = ClaimVerdict.SAME if stored.split()[0] == fingerprint else ClaimVerdict.DIFFERENT
        return Claim(request_id, verdict, stored)

    async def holds(self, claim: Claim) -> bool:
        """The key still holds this very claim (not released, not taken over)."""
        return await self._client.get(claim_key(claim.request_id)) == claim.value

    async def release(self, claim: Claim) -> bool:
        """Lets go of a claim whose submission was refused; False if it was no longer held."""
        return bool(await self._delete_if(keys=[claim_key(claim.request_id)], args=[claim.value]))

    async def aclose(self) -> None:
        await self._client.aclose()
