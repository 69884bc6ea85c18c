"""Which API key owns a request id, for the calls that name a request by id: status, cancel, resume.

With API keys on, a request belongs to the key that submitted it (its name travels in
SubmitRequest.owner to the Redis record), and another key asking about that id is told the id is
not found, the same answer as for an id that never existed, so ids cannot be probed. Requests this
gateway streams under an id it made are known in memory (their record may not be written yet); any
other is looked up in its Redis record. Without API keys (caller None) nothing is checked: every client is the same client.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

from kvstore.state_reader import RequestStateReader
from core.errors import NotFound


class RequestOwners:
    def __init__(self, records: RequestStateReader | None) -> None:
        self.records = records
        self._live: dict[str, str] = {}  # request id -> owner, while this gateway streams it

    @contextlib.contextmanager
    def streaming(self, request_id: str, owner: str | None) -> Iterator[None]:
        if owner is None:
            yield
            return
        self._live[request_id] = owner
        try:
            yield
        finally:
            self._live.pop(request_id, None)

    async def owner_of(self, request_id: str) -> str | None:
        if request_id in self._live:
            return self._live[request_id]
        return await self.recorded_owner(request_id)

    async def recorded_owner(self, request_id: str, wait_s: float = 0.0) -> str | None:
        """From the Redis record only (what an attach to a client-chosen id checks). wait_s: how long
        to wait for a record that is not written yet (the scheduler writes it a few ms after taking
        the request, so an id seen live a moment ago may have none yet)."""
        if self.records is None:
            return None
        deadline = time.monotonic() + wait_s
        while (record := await self.records.get_record(request_id)) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return record.owner if record is not None else None

    async def check(self, request_id: str, caller: str | None) -> None:
        """NotFound unless caller owns request_id (or keys are off)."""
        if caller is not None and await self.owner_of(request_id) != caller:
            raise NotFound("request", request_id)
