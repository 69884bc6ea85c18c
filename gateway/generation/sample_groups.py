"""The requests an n > 1 / best_of request became (gateway.generation.samples: `<id>-0 .. <id>-(best_of-1)`),
for the calls that name a request by the client's id: CancelRequest, GetRequestStatus, and the record of
why an idle stream was cut.

    with groups.streaming(request_id, sample_ids(prepared), caller):   # around streaming the samples
        ...
    groups.live(request_id)                  # SampleGroup(sample_ids, owner), or None
    candidate_sample_ids(request_id, limits.max_samples)
    group_record(request_id, sample_records) # one RequestRecord standing for them all

A gateway knows the groups it streams. A call that reaches another gateway replica (or arrives after
the stream ended) derives them instead of asking a shared registry: sample ids are made from the
client's id alone, best_of is at most Limits.max_samples, and the scheduler refuses a second running
request under a running id (AlreadyExists), so while an n > 1 request runs `<id>-i` names its sample i
and nothing else. Aborting an id that does not run is a no-op, so the candidates need no Redis. The
caller tries the id itself first, so cancelling a plain request never touches `<id>-0 ..`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from kvstore.records import RecordStatus, RequestRecord


@dataclass(frozen=True, slots=True)
class SampleGroup:
    sample_ids: list[str]
    owner: str | None  # the API key that sent it (None: keys off)


class SampleGroups:
    def __init__(self) -> None:
        self._live: dict[str, SampleGroup] = {}  # client's request id -> its samples, while streamed here

    @contextlib.contextmanager
    def streaming(self, request_id: str, sample_ids: list[str], owner: str | None) -> Iterator[None]:
        group = SampleGroup(sample_ids, owner)
        # a second request under a running id fails at the scheduler (AlreadyExists): it replaces nothing
        registered = self._live.setdefault(request_id, group) is group
        try:
            yield
        finally:
            if registered:
                del self._live[request_id]

    def live(self, request_id: str) -> SampleGroup | None:
        return self._live.get(request_id)


def candidate_sample_ids(request_id: str, max_samples: int) -> list[str]:
    """Every id a sample of request_id can have (best_of <= max_samples)."""
    return [f"{request_id}-{index}" for index in range(max_samples)]


def group_record(request_id: str, samples: list[RequestRecord]) -> RequestRecord:
    """The request's state from its samples' records (sample 0 first): running while any sample is not
    ended; once all are, failed if one failed, else cancelled if one was, else finished. The prompt once,
    every sample's output tokens and preemptions; the earliest start times, the last finish."""
    statuses = {sample.status for sample in samples}
    ended = all(sample.is_terminal for sample in samples)
    if not ended:
        status = RecordStatus.RUNNING if RecordStatus.RUNNING in statuses else RecordStatus.QUEUED
    else:
        status = next(s for s in (RecordStatus.FAILED, RecordStatus.CANCELLED, RecordStatus.FINISHED)
                      if s in statuses)
    first = samples[0]
    failed = next((sample for sample in samples if sample.status is RecordStatus.FAILED), None)
    reason_from = failed or first
    return RequestRecord(
        request_id, status, num_preemptions=sum(sample.num_preemptions for sample in samples),
        num_prompt_tokens=first.num_prompt_tokens,
        num_output_tokens=sum(sample.num_output_tokens for sample in samples),
        created_at=_earliest(sample.created_at for sample in samples),
        first_scheduled_at=_earliest(sample.first_scheduled_at for sample in samples),
        first_token_at=_earliest(sample.first_token_at for sample in samples),
        finished_at=_latest(sample.finished_at for sample in samples) if ended else None,
        finish_reason=reason_from.finish_reason if ended else None,
        error=reason_from.error, error_code=reason_from.error_code, model=first.model, priority=first.priority,
        owner=first.owner)


def _earliest(times) -> float | None:
    known = [value for value in times if value is not None]
    return min(known) if known else None


def _latest(times) -> float | None:
    known = [value for value in times if value is not None]
    return max(known) if known else None
