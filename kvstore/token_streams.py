"""Each resumable request's tokens as a Redis Stream, `tokenmill:tokens:{request_id}`, so a client
whose gateway died mid-stream resumes through any gateway without losing or repeating a token.

One stream entry per step delta, written by the scheduler (which keeps running a resumable request
when its gateway goes away):

    i  index of the entry's first token among the request's output tokens (0-based)
    t  the token ids, space-separated ("" on a finish-only entry)
    f  on the last entry only: the finish reason, core.outputs.FinishReason's name ("STOP", "LENGTH", ...)
    c  on the last entry, when it failed: the error's core.errors.ErrorCode name ("DEADLINE_EXCEEDED", ...)
    e  on the last entry, when it failed: the error's message
    p  on the last entry: prompt tokens

Writes follow the state writer's rules (DESIGN invariant 6): `append()` and `finish()` only queue;
a background task writes the queue in order and keeps it to retry with backoff while Redis is away,
so the stream catches up (in order) once Redis is back. Reads are plain awaits for the gateway, which
wants to know when Redis is away.

One command per flush, whatever the number of requests: the queue goes to Redis as one JSON argument
of one script call (APPEND_ENTRIES_LUA: the XADD and EXPIRE of every entry, server-side, in queue
order), not as an XADD + EXPIRE per request in a pipeline. Same single round trip, but redis-py packs
and parses two commands per request in a pipeline: at 256 requests a flush cost the scheduler 6.4 ms
of CPU (25 us per entry) against 0.3 ms (1.1 us per entry) as one JSON script call, and 1.1 ms with
the keys declared one by one (KEYS + flat ARGV; `scripts/bench_scheduler_step.py --redis-only`).
The keys are built inside the script: fine on a single Redis, which is all tokenmill uses; Redis
Cluster would need them declared (the KEYS variant, still 5x cheaper than the pipeline). redis-py loads
the script again by itself when a restarted Redis answers NOSCRIPT.

Why a client never loses or repeats a token across a crash (the resume and re-admission guarantee),
with this write path:

- a step's tokens reach the writer's queue in the same synchronous call that hands them to the client's
  stream (scheduler.process.request_streams.deliver), so the queue's order is the order clients see;
- the queue is written in order: one script call per flush carries a prefix of the queue; the entries
  leave the queue only after Redis acknowledged the call, and a failed call is retried with the same
  entries first. A script runs atomically, so a flush lands whole or not at all; a call whose reply was
  lost and is sent again repeats whole entries, each with its start index `i`, which readers skip by;
- so what a scheduler crash can lose is a suffix of a request's tokens: those queued but not yet written
  (one flush interval's worth, or more while Redis is away). The restarted scheduler re-admits the
  request from the prefix in Redis and recomputes the rest (scheduler.process.readmission); the gateway
  following the request skips by index the tokens its client already has. A token a client has seen is
  therefore either in Redis or computed again at the same index: the same token under greedy decoding
  with `--deterministic` (without it, batch composition may change a later greedy token: see
  docs/reliability.md).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections import deque
from dataclasses import dataclass

from redis.exceptions import RedisError

from core.errors import ErrorCode, ServingError, error_from_code
from core.outputs import FinishReason
from kvstore.background_flush import BackgroundFlush
from kvstore.client import connect
from plumbing.telemetry.tracing import WriteCauses

logger = logging.getLogger(__name__)
TOKEN_STREAM_PREFIX = "tokenmill:tokens:"


def token_stream_key(request_id: str) -> str:
    return TOKEN_STREAM_PREFIX + request_id


@dataclass(slots=True)
class TokenEntry:
    """One decoded stream entry."""

    index: int
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    error: ServingError | None = None  # rebuilt from its code and message: the same type it was written as
    num_prompt_tokens: int = 0

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> TokenEntry:
        text = fields.get("t", "")
        finish, code = fields.get("f"), fields.get("c")
        return cls(index=int(fields.get("i", "0")), token_ids=[int(t) for t in text.split()] if text else [],
                   finish_reason=FinishReason[finish] if finish else None,
                   error=error_from_code(ErrorCode[code], fields.get("e", "")) if code else None,
                   num_prompt_tokens=int(fields.get("p", "0")))


# KEYS: none. ARGV[1]: the TTL in seconds; ARGV[2]: JSON [[request_id, field, value, field, value, ...], ...]
# in queue order. Returns the number of entries written.
APPEND_ENTRIES_LUA = """
local ttl = ARGV[1]
local entries = cjson.decode(ARGV[2])
for n = 1, #entries do
  local entry = entries[n]
  local key = '""" + TOKEN_STREAM_PREFIX + """' .. entry[1]
  redis.call('XADD', key, '*', unpack(entry, 2))
  redis.call('EXPIRE', key, ttl)
end
return #entries
"""


class TokenStreamWriter(BackgroundFlush):
    _task_name = "token-stream-writer"

    def __init__(self, redis_url: str, *, ttl_s: int = 3600, flush_interval_s: float = 0.01,
                 max_pending: int = 100_000, retry_max_s: float = 1.0, batch_max: int = 8192) -> None:
        self._client = connect(redis_url)
        self._append_entries = self._client.register_script(APPEND_ENTRIES_LUA)
        self._ttl_s = ttl_s
        self._flush_interval_s = flush_interval_s
        self._max_pending = max_pending
        self._retry_max_s = retry_max_s
        # entries per script call: a step of 1,024 requests fits many times over, while the catch-up
        # after a long outage goes in calls that each hold Redis for milliseconds, not seconds
        self._batch_max = batch_max
        # (request_id, entry fields), in order. A dict of strings stays outside the cyclic GC's tracking; the
        # script's flat list built at append instead (one json.dumps a flush) measured slower in the scheduler
        # step benchmark with the GC on (deliver +1.3-1.6 us a token at 256 requests), not with it off
        self._pending: deque[tuple[str, dict[str, str]]] = deque()
        self._has_work = asyncio.Event()
        self._flushing = False  # a pipeline is in flight: its entries are the first len(batch)
        self._causes = WriteCauses()  # the step spans whose tokens the next pipeline carries
        self.dropped = 0  # entries dropped past max_pending while Redis was away (oldest first)
        self.round_trips = 0  # script calls sent (one per flush, failed ones included)
        self.healthy = True

    @property
    def pending(self) -> int:
        """Entries not yet written."""
        return len(self._pending)

    # ---- caller side: synchronous, no I/O ----

    def append(self, request_id: str, start_index: int, token_ids: list[int]) -> None:
        self._queue(request_id, {"i": str(start_index), "t": " ".join(map(str, token_ids))})

    def finish(self, request_id: str, end_index: int, finish_reason: FinishReason, error: ServingError | None,
               num_prompt_tokens: int) -> None:
        fields = {"i": str(end_index), "t": "", "f": finish_reason.name, "p": str(num_prompt_tokens)}
        if error is not None:
            fields["c"], fields["e"] = error.code.name, str(error)
        self._queue(request_id, fields)

    def _queue(self, request_id: str, fields: dict[str, str]) -> None:
        self._causes.note()
        self._pending.append((request_id, fields))
        if len(self._pending) > self._max_pending and not self._flushing:
            self._pending.popleft()
            self.dropped += 1
            if str(self.dropped).rstrip("0") == "1":  # at 1, 10, 100, ...: a long outage keeps saying so
                logger.warning("Redis away past max_pending=%d token-stream entries: %d dropped so far, oldest "
                               "first (tokenmill:redis_writes_dropped_total)", self._max_pending, self.dropped)
        self._has_work.set()

    # ---- background side (start / aclose / the flush task: kvstore.background_flush) ----

    async def _flush(self) -> bool:
        """Writes what is pending, in order, as one script call; False (entries kept) if Redis could not
        be reached."""
        batch = list(itertools.islice(self._pending, self._batch_max))
        payload = json.dumps([[request_id, *itertools.chain.from_iterable(fields.items())]
                              for request_id, fields in batch], separators=(",", ":"))
        self._flushing = True
        self.round_trips += 1
        try:
            with self._causes.batch_span("kvstore.token_streams.write"):  # linked to the steps behind it
                await self._append_entries(args=[self._ttl_s, payload])
        except (RedisError, OSError, TimeoutError) as error:
            if self.healthy:
                logger.warning("token stream write failed, keeping %d entries to retry: %s", len(batch), error)
            self.healthy = False
            return False
        finally:
            self._flushing = False
        # a resend after a lost reply repeats entries: readers skip by index (see TokenStreamReader), so a
        # repeat never reaches a client
        for _ in batch:
            self._pending.popleft()
        self.healthy = True
        return True


class TokenStreamReader:
    def __init__(self, redis_url: str) -> None:
        self._client = connect(redis_url, socket_timeout_s=5.0)

    async def exists(self, request_id: str) -> bool:
        return bool(await self._client.exists(token_stream_key(request_id)))

    async def read(self, request_id: str, after: str = "0", block_ms: int = 1000) -> tuple[str, list[TokenEntry]]:
        """Entries after the stream id `after` ("0": from the start), waiting up to block_ms for one;
        returns the id to pass next time and the entries (empty when none came)."""
        reply = await self._client.xread({token_stream_key(request_id): after}, block=block_ms, count=1000)
        entries = []
        for _, messages in reply or ():
            for entry_id, fields in messages:
                after = entry_id
                entries.append(TokenEntry.from_fields(fields))
        return after, entries

    async def aclose(self) -> None:
        await self._client.aclose()
