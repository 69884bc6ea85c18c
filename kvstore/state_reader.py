"""Reads of request records, and the clean-up a restarting scheduler runs for requests it lost.

Unlike the writer these calls await Redis and raise `redis.exceptions.RedisError` when it is away:
they serve status queries and start-up, where the caller wants to know.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterable

from redis.exceptions import ResponseError

from kvstore.client import connect
from kvstore.record_update import UPDATE_RECORDS_LUA, RecordUpdate, parse_results, script_args
from core.errors import ServingError
from core.outputs import FinishReason
from kvstore.records import RecordStatus, RequestRecord, encode_field, record_key

_ORPHANS_PER_CALL = 1000


class RequestStateReader:
    def __init__(self, redis_url: str, *, ttl_s: int = 3600, socket_timeout_s: float = 2.0) -> None:
        self._ttl_s = ttl_s  # applied to the records mark_orphans_failed ends
        self._client = connect(redis_url, socket_timeout_s=socket_timeout_s)
        self._script = self._client.register_script(UPDATE_RECORDS_LUA)

    async def get_record(self, request_id: str) -> RequestRecord | None:
        mapping = await self._client.hgetall(record_key(request_id))
        return RequestRecord.from_mapping(mapping) if mapping else None

    async def mark_orphans_failed(
        self, request_ids: Iterable[str], error: ServingError, *, at: float | None = None, must_exist: bool = True
    ) -> list[str]:
        """End as failed the records of requests a restarted scheduler no longer has.

        Only records that are not terminal change (atomically, so a record its writer finishes at the
        same moment stays finished), and with must_exist only records that exist: False is for a
        caller that knows the request was accepted (a gateway that saw its scheduler die before the
        scheduler's batched first write). Returns the ids that were marked failed.
        """
        request_ids = list(dict.fromkeys(request_ids))
        finished_at = encode_field("finished_at", time.time() if at is None else at)
        write_id_prefix = uuid.uuid4().hex[:12] + ":orphan:"
        marked: list[str] = []
        # chunks keep each script call (which holds Redis while it runs) short
        for start in range(0, len(request_ids), _ORPHANS_PER_CALL):
            chunk = request_ids[start : start + _ORPHANS_PER_CALL]
            updates = []
            for index, request_id in enumerate(chunk, start):
                update = RecordUpdate(request_id, write_id_prefix + str(index), must_exist=must_exist)
                update.add_status(RecordStatus.FAILED.value)
                update.set_field("error", encode_field("error", str(error)))
                update.set_field("error_code", encode_field("error_code", error.code))
                update.set_field("finish_reason", encode_field("finish_reason", FinishReason.ERROR))
                update.set_field("finished_at", finished_at)
                updates.append(update)
            keys, args = script_args(updates, self._ttl_s)
            results, first_error = parse_results(await self._script(keys=keys, args=args))
            if first_error is not None:
                raise ResponseError(f"Redis refused {results.count(None)} orphan records: {first_error}")
            marked += [request_id for request_id, result in zip(chunk, results) if result[0]]
        return marked

    async def aclose(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> RequestStateReader:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
