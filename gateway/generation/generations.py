"""The one place a generation's route is chosen, for every API (tokenmill.v1, OpenAI HTTP, KServe v2).

    generations = Generations(tokenizer, scheduler, records, resume)   # once, in gateway.main
    call = CallContext.at_edge(arrival, timeout_s, owner=..., chosen_id=..., resume_from=...)
    deltas = generations.stream(prepared, call)
    async with contextlib.aclosing(deltas):
        async for delta in deltas:         # GenerationDelta; delta.index: the sample (n > 1)
            ...

The route, chosen once per request:

| request | route | resume (call.resume_from) |
| --- | --- | --- |
| n or best_of > 1 | the samples side by side on one scheduler (gateway.generation.samples) | InvalidArgument: samples are not resumable |
| one sample, Redis on | submit_or_attach (gateway.generation.resume): client ids claimed, resumable, attaches to a known id, goes on through a scheduler restart | attaches from that index |
| one sample, no Redis | the plain stream (gateway.generation.stream) | Unavailable: resume needs Redis |

While a request streams, whose it is (gateway.generation.ownership) and, for n > 1, the samples it
became (gateway.generation.sample_groups) are known here, whichever API it came by, for the calls that
name a request by id (tokenmill.v1 GetRequestStatus, CancelRequest).
"""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from core.errors import InvalidArgument, Unavailable
from gateway.generation.context import CallContext, SchedulerSide
from gateway.generation.lost_requests import LostRequestRecorder
from gateway.generation.ownership import RequestOwners
from gateway.generation.resume import ResumeStore, submit_or_attach
from gateway.generation.sample_groups import SampleGroups
from gateway.generation.samples import sample_ids, stream_samples
from gateway.generation.stream import GenerationDelta, stream_generation
from gateway.prepare.request_builder import PreparedRequest
from gateway.text.tokenizer import TextTokenizer
from gateway.upstream.target import SchedulerTarget
from kvstore.state_reader import RequestStateReader
from plumbing.telemetry import metrics


class Generations(SchedulerSide):
    """The tokenizer, the scheduler target and the Redis side (records, token streams, claims, owners,
    followers), held once for the three APIs; plus the owners and sample groups of what streams here."""

    def __init__(self, tokenizer: TextTokenizer, scheduler: SchedulerTarget,
                 records: RequestStateReader | None = None, resume: ResumeStore | None = None,
                 stream_interval: int = 1) -> None:
        """records: the requests' Redis records (None without Redis): a request its scheduler loses, and that
        resume does not carry on (n > 1, or no token streams), is marked failed there. stream_interval: tokens
        per message after a stream's first (gateway.generation.stream.every_interval)."""
        super().__init__(tokenizer, scheduler, LostRequestRecorder(records) if records is not None else None,
                         stream_interval)
        self.records = records
        self.resume = resume  # None without Redis: the plain route, no resume
        self.owners = resume.owners if resume is not None and resume.owners is not None else RequestOwners(records)
        self.sample_groups = SampleGroups()  # the n > 1 requests streamed here: their sample ids

    def is_resumable(self, prepared: PreparedRequest) -> bool:
        """Whether stream() runs it resumable: a client may resume it by id and index (Last-Event-ID)."""
        return self.resume is not None and prepared.best_of == 1

    async def stream(self, prepared: PreparedRequest, call: CallContext) -> AsyncIterator[GenerationDelta]:
        """The request's deltas on its route (the table above). Leaving early cancels it (its pages are freed)."""
        request_id = prepared.request.request_id
        deltas = self._route(prepared, call)
        if call.resume_from is None:  # once per client request (vllm:request_params_n, _max_tokens)
            metrics.observe_request_params(prepared.n, prepared.request.sampling_params.max_tokens)
        samples = sample_ids(prepared) if prepared.best_of > 1 else []
        # only an id this gateway made is surely the caller's before the scheduler takes it; a client-chosen
        # one may name another key's request, and its owner is then known from its Redis record
        with (self.owners.streaming(request_id, None if call.chosen_id else call.owner),
              self.sample_groups.streaming(request_id, samples, call.owner) if samples else contextlib.nullcontext()):
            async with contextlib.aclosing(deltas):
                async for delta in deltas:
                    yield delta

    def _route(self, prepared: PreparedRequest, call: CallContext) -> AsyncIterator[GenerationDelta]:
        if prepared.best_of > 1:  # several samples: requests <request_id>-<index>
            if call.resume_from is not None:
                raise InvalidArgument(call.resume_field, call.resume_from,
                                      "a request with n or best_of > 1 cannot be resumed")
            return stream_samples(prepared, call, self)
        if self.resume is None:
            if call.resume_from is not None:
                raise Unavailable(f"{call.resume_field} needs Redis; this gateway runs without --redis-url")
            return stream_generation(prepared, call, self)
        return submit_or_attach(prepared, call, self, self.resume)

