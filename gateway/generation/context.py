"""What one generation runs with, in two halves: the call's (CallContext, built by each API at its edge
from its own wire: gRPC context, HTTP headers) and the gateway's (SchedulerSide, made once per process).

    call = CallContext.at_edge(arrival, timeout_s=context.time_remaining(), owner="alice",
                               chosen_id=True, resume_from=None, resume_field="resume_from_index")
    call.time_left()        # seconds to the deadline now (None: no deadline)

No protobuf or aiohttp object crosses into gateway.generation: what the routes need of a call is here.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from core.errors import ServingError
from gateway.text.tokenizer import TextTokenizer
from gateway.upstream.target import SchedulerTarget

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CallContext:
    arrival: float  # time.monotonic() when the request reached the gateway (its timings count from it)
    # the client's deadline (Unix seconds; None: none). It travels twice: as the scheduler call's timeout,
    # and in the request, so the scheduler ends the request (and frees its pages) itself when it passes
    deadline_unix_s: float | None = None
    owner: str | None = None  # the API key name that sent it (gateway.generation.ownership); None: keys off
    chosen_id: bool = False  # the client chose the request id (tokenmill.v1 request_id, HTTP X-Request-Id): claimed
    resume_from: int | None = None  # the token index to resume an existing request from; None: a new request
    resume_field: str = "resume_from_index"  # how the client's wire names resume_from, for its refusals

    @classmethod
    def at_edge(cls, arrival: float, timeout_s: float | None = None, **fields) -> CallContext:
        """timeout_s: the client's time left, read with nothing awaited since (the deadline counts from now)."""
        return cls(arrival, None if timeout_s is None else time.time() + timeout_s, **fields)

    def time_left(self) -> float | None:
        return None if self.deadline_unix_s is None else max(self.deadline_unix_s - time.time(), 0.0)


class SchedulerSide:
    """The gateway's half of every route: the tokenizer (token ids -> text), the scheduler target requests
    go to (gateway.upstream.target), and what a request cut or lost on the way leaves to do: its abort, sent
    in the background, and its Redis record, marked failed (gateway.generation.lost_requests)."""

    def __init__(self, tokenizer: TextTokenizer, scheduler: SchedulerTarget,
                 on_request_lost: Callable[[str, ServingError, bool], None] | None = None,
                 stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.stream_interval = stream_interval  # tokens per message after the first (--stream-interval)
        # (request_id, error, accepted): a request whose scheduler stream broke; the gateway ends its record
        self.on_request_lost = on_request_lost
        # set by the gateway before it stops its servers: calls cancelled by that are not client cancels,
        # and resumable requests must keep running for a client to resume them on another gateway
        self.shutting_down = False
        self._background: set[asyncio.Task] = set()

    def report_lost(self, request_id: str, error: ServingError, accepted: bool) -> None:
        """accepted: the scheduler had sent tokens, so the request surely existed there."""
        if self.on_request_lost is not None:
            self.on_request_lost(request_id, error, accepted)

    def abort_in_background(self, request_id: str) -> None:
        """Abort without waiting (from a cancelled handler's clean-up); a failure is only logged."""
        if self.shutting_down:
            return
        task = asyncio.get_running_loop().create_task(self._abort_quietly(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self.scheduler.abort([request_id])
        except ServingError as error:
            logger.warning("abort of %r failed: %s", request_id, error)
        except Exception as error:  # e.g. the channel closed under it while the gateway stops
            logger.warning("abort of %r failed: %r", request_id, error)
