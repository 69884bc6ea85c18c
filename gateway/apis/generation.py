"""tokenmill.v1.Generation servicer: the public API. Thin: build the request, stream, convert back."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import RedisError

from gateway.access.control import AccessControl, caller_key, caller_name
from gateway.apis.served_model import ServedModel
from gateway.apis.stream_idle import IdleWatchdog, StreamIdle, record_idle
from gateway.generation.context import CallContext
from gateway.generation.sample_groups import candidate_sample_ids, group_record
from gateway.generation.samples import check_streamable
from gateway.generation.stream import GenerationDelta, TokenLogprob
from gateway.prepare.request_builder import check_constraints, prepare, prompt_token_ids, sandbox_or_default
from kvstore.records import RecordStatus, RequestRecord
from protos import codec
from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from core.errors import NotFound, Unavailable
from gateway.telemetry import CHAT, TEXT_COMPLETION, request_scope
from plumbing.grammar_sandbox import GrammarSandbox

logger = logging.getLogger(__name__)

_STATUS = {
    RecordStatus.QUEUED: generation_pb2.REQUEST_STATUS_QUEUED,
    RecordStatus.RUNNING: generation_pb2.REQUEST_STATUS_RUNNING,
    RecordStatus.FINISHED: generation_pb2.REQUEST_STATUS_FINISHED,
    RecordStatus.FAILED: generation_pb2.REQUEST_STATUS_FAILED,
    RecordStatus.CANCELLED: generation_pb2.REQUEST_STATUS_CANCELLED,
}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, model: ServedModel, access: AccessControl | None = None,
                 constraints: GrammarSandbox | None = None) -> None:
        self.generations = model.generations  # the route choice; the scheduler, Redis records, owners, groups
        self.tokenizer = model.tokenizer
        self.constraints = sandbox_or_default(constraints)  # compiles client constraints off the event loop
        self.scheduler = model.generations.scheduler
        self.limits = model.limits
        self.model_info = model.info
        self.model_name = model.name
        self.state_reader = model.generations.records  # kvstore.RequestStateReader, or None without Redis
        self.access = access  # whose request an id is (None: keys off)
        self.owners = model.generations.owners
        self.sample_groups = model.generations.sample_groups  # the n > 1 requests streamed here: their sample ids

    # --stream-idle-timeout-s (gateway.main sets it); 0: a stream may wait on its client for ever
    stream_idle_timeout_s: float = 0.0

    async def GenerateStream(self, request, context):
        # context.write, not yield: a write blocked on a client that stopped reading can time out
        async with contextlib.aclosing(self._generate(request, context, streaming=True)) as messages:
            with IdleWatchdog(self.stream_idle_timeout_s) as watchdog:
                try:
                    async for message in messages:
                        await watchdog.write(context.write(message))
                except StreamIdle as error:
                    # before leaving the block aborts the request (whose record would say only "cancelled");
                    # an n > 1 request's records are its samples'
                    group = self.sample_groups.live(message.request_id)
                    ids = group.sample_ids if group is not None else [message.request_id]
                    await record_idle(self.state_reader, ids, error)
                    raise

    async def Generate(self, request, context):
        reply = generation_pb2.GenerateResponse()
        choices: dict[int, generation_pb2.Choice] = {}
        async for message in self._generate(request, context, streaming=False):
            reply.request_id = message.request_id
            choice = choices.setdefault(message.index, generation_pb2.Choice(index=message.index))
            choice.text += message.text
            choice.token_ids.extend(message.token_ids)
            choice.logprobs.extend(message.logprobs)
            if message.index == 0:  # every sample computes the same prompt logprobs
                reply.prompt_logprobs.extend(message.prompt_logprobs)
            if message.finish_reason:
                choice.finish_reason, choice.matched_stop = message.finish_reason, message.matched_stop
                choice.usage.CopyFrom(message.usage)
                if message.index == 0:
                    reply.timings.CopyFrom(message.timings)
        reply.choices.extend(choices[index] for index in sorted(choices))
        if reply.choices:  # the top-level fields are choice 0's (what a client asking for one reads)
            first = reply.choices[0]
            reply.text, reply.finish_reason, reply.matched_stop = first.text, first.finish_reason, first.matched_stop
            reply.token_ids.extend(first.token_ids)
            reply.logprobs.extend(first.logprobs)
            # the prompt once, every choice's completion; cached: what the sample that computed the prompt found
            reply.usage.prompt_tokens = first.usage.prompt_tokens
            reply.usage.completion_tokens = sum(choice.usage.completion_tokens for choice in reply.choices)
            reply.usage.cached_prompt_tokens = min(choice.usage.cached_prompt_tokens for choice in reply.choices)
        return reply

    async def _generate(self, request, context, streaming: bool):
        arrival = time.monotonic()
        operation = CHAT if request.WhichOneof("input") == "messages" else TEXT_COMPLETION
        with request_scope(request.request_id, operation):  # a refusal here still names its request
            prepared = prepare(request, self.tokenizer, self.limits, self.model_name)
            await check_constraints(prepared, self.constraints)
        key = caller_key(self.access, context)
        if key is not None:  # its latency targets, its class of service, travel with the request
            prepared.request = key.with_targets(prepared.request)
        if streaming and prepared.best_of > 1:
            check_streamable(prepared)
        call = CallContext.at_edge(arrival, context.time_remaining(), owner=None if key is None else key.name,
                                   chosen_id=bool(request.request_id),
                                   resume_from=request.resume_from_index if request.HasField("resume_from_index")
                                   else None)
        deltas = self.generations.stream(prepared, call)
        async with contextlib.aclosing(deltas):
            async for delta in deltas:
                yield _stream_response(delta, prepared.request.request_id)

    async def Tokenize(self, request, context):
        ids = prompt_token_ids(request, self.tokenizer, self.limits, request.add_special_tokens)
        return generation_pb2.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request, context):
        from gateway.prepare.validation import validate_prompt_ids

        validate_prompt_ids(list(request.token_ids), self.limits)
        return generation_pb2.DetokenizeResponse(
            text=self.tokenizer.decode(list(request.token_ids), request.skip_special_tokens))

    async def GetModelInfo(self, request, context):
        return self.model_info

    async def GetRequestStatus(self, request, context):
        if self.state_reader is None:
            raise Unavailable("request status needs Redis; this gateway runs without --redis-url")
        record = await self._record_or_group(request.request_id)
        caller = caller_name(self.access, context)
        if record is None or (caller is not None and record.owner != caller):
            raise NotFound("request", request.request_id)
        return self._status_reply(record)

    async def CancelRequest(self, request, context):
        request_id, caller = request.request_id, caller_name(self.access, context)
        group = self.sample_groups.live(request_id)
        if group is not None:  # an n > 1 request streamed here: all its samples
            if caller is not None and group.owner != caller:
                raise NotFound("request", request_id)
            aborted = await self.scheduler.abort(group.sample_ids)
        else:
            aborted = await self._abort_one_or_samples(request_id, caller)
        status = generation_pb2.REQUEST_STATUS_CANCELLED if aborted else generation_pb2.REQUEST_STATUS_UNSPECIFIED
        if not aborted and self.state_reader is not None:
            record = await self._record_or_group(request_id)
            if record is None or (caller is not None and record.owner != caller):
                raise NotFound("request", request_id)
            status = _STATUS[record.status]
        return generation_pb2.CancelRequestResponse(cancelled=bool(aborted), status=status)

    async def _abort_one_or_samples(self, request_id: str, caller: str | None) -> list[str]:
        """The request itself if it runs, else the samples of an n > 1 request another gateway (or this
        one, before) streamed: derived from the id (gateway.generation.sample_groups says why that is sound)."""
        refused, aborted = None, []
        try:
            await self.owners.check(request_id, caller)
        except NotFound as error:
            refused = error  # not the caller's, or no plain request: an n > 1 request's samples may be
        else:
            aborted = await self.scheduler.abort([request_id])
        if aborted:
            return aborted
        if caller is None:
            candidates = candidate_sample_ids(request_id, self.limits.max_samples)
        else:  # keys on: only samples whose records name the caller
            candidates = [record.request_id for record in await self._sample_records(request_id)
                          if record.owner == caller]
        if refused is not None and not candidates:
            raise refused
        return await self.scheduler.abort(candidates) if candidates else []

    async def _record_or_group(self, request_id: str) -> RequestRecord | None:
        """The request's record, or for an n > 1 request one standing for its samples' (None: neither)."""
        record = await self._record(request_id)
        if record is None and (samples := await self._sample_records(request_id)):
            record = group_record(request_id, samples)
        return record

    async def _sample_records(self, request_id: str) -> list[RequestRecord]:
        """The records of request_id's samples: <id>-0, <id>-1, ... up to the first without one."""
        if self.state_reader is None:
            return []
        first_id, *other_ids = candidate_sample_ids(request_id, self.limits.max_samples)
        first = await self._record(first_id)
        if first is None:  # not an n > 1 request (one Redis read for a plain id that is unknown)
            return []
        records = [first]
        for record in await asyncio.gather(*(self._record(sample_id) for sample_id in other_ids)):
            if record is None:
                break
            records.append(record)
        return records

    async def _record(self, request_id: str) -> RequestRecord | None:
        """The request's Redis record; Unavailable (not INTERNAL) while Redis does not answer: status is
        bookkeeping, and generation goes on without it (DESIGN invariant 6)."""
        try:
            return await self.state_reader.get_record(request_id)
        except (RedisError, OSError) as error:
            raise Unavailable(f"request status is unavailable while Redis does not answer ({error}); "
                              f"generation is not affected, retry later") from error

    @staticmethod
    def _status_reply(record) -> generation_pb2.GetRequestStatusResponse:
        reply = generation_pb2.GetRequestStatusResponse(
            request_id=record.request_id, status=_STATUS[record.status],
            finish_reason=codec.finish_reason_to_proto(record.finish_reason), error=record.error or "",
            num_preemptions=record.num_preemptions, num_prompt_tokens=record.num_prompt_tokens or 0,
            num_output_tokens=record.num_output_tokens or 0)
        for field, value in (("arrival_time", record.created_at), ("first_scheduled_time", record.first_scheduled_at),
                             ("first_token_time", record.first_token_at), ("finish_time", record.finished_at)):
            if value is not None:
                getattr(reply, field).FromNanoseconds(int(value * 1e9))
        return reply


def _stream_response(delta: GenerationDelta, request_id: str) -> generation_pb2.GenerateStreamResponse:
    """request_id: the client's request (a sample's delta names its own scheduler request, <id>-<index>)."""
    out = generation_pb2.GenerateStreamResponse(request_id=request_id, text=delta.text, token_ids=delta.token_ids,
                                                index=delta.index)
    _add_logprobs(out.logprobs, delta.logprobs)
    _add_logprobs(out.prompt_logprobs, delta.prompt_logprobs or [])
    finish = delta.finish
    if finish is not None:
        out.finish_reason = codec.finish_reason_to_proto(finish.reason)
        out.matched_stop = finish.matched_stop
        out.usage.prompt_tokens = finish.prompt_tokens
        out.usage.completion_tokens = finish.completion_tokens
        out.usage.cached_prompt_tokens = finish.cached_prompt_tokens
        out.timings.queue_ns = finish.queue_ns
        out.timings.first_token_forward_ns = finish.first_token_forward_ns
        out.timings.time_to_first_token_ns = finish.time_to_first_token_ns
        out.timings.decode_ns = finish.decode_ns
        out.timings.e2e_ns = finish.e2e_ns
    return out


def _add_logprobs(out, entries: list[TokenLogprob]) -> None:
    for entry in entries:
        logprob = out.add(token_id=entry.token_id, token=entry.token, logprob=entry.logprob)
        for top in entry.top:
            logprob.top_logprobs.add(token_id=top.token_id, token=top.token, logprob=top.logprob)
