"""tokenmill.v1.Generation servicer: the public API. Thin: build the request, stream, convert back."""
from __future__ import annotations

import time

import grpc

from gateway.request_builder import prepare, prompt_token_ids
from gateway.scheduler_client import SchedulerClient
from gateway.text_stream import TextStream
from gateway.tokenizer import TextTokenizer
from gateway.validation import Limits
from kvstore.records import RecordStatus
from protos import codec
from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tokenmill.errors import NotFound, Unavailable

_STATUS = {
    RecordStatus.QUEUED: generation_pb2.REQUEST_STATUS_QUEUED,
    RecordStatus.RUNNING: generation_pb2.REQUEST_STATUS_RUNNING,
    RecordStatus.FINISHED: generation_pb2.REQUEST_STATUS_FINISHED,
    RecordStatus.FAILED: generation_pb2.REQUEST_STATUS_FAILED,
    RecordStatus.CANCELLED: generation_pb2.REQUEST_STATUS_CANCELLED,
}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: TextTokenizer, scheduler: SchedulerClient, limits: Limits,
                 model_info: common_pb2.GetModelInfoResponse, state_reader=None) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.limits = limits
        self.model_info = model_info
        self.model_name = model_info.model_config.name
        self.state_reader = state_reader  # kvstore.RequestStateReader, or None without Redis

    async def GenerateStream(self, request, context):
        async for message in self._generate(request, context):
            yield message

    async def Generate(self, request, context):
        reply = generation_pb2.GenerateResponse()
        async for message in self._generate(request, context):
            reply.request_id = message.request_id
            reply.text += message.text
            reply.token_ids.extend(message.token_ids)
            reply.logprobs.extend(message.logprobs)
            if message.finish_reason:
                reply.finish_reason, reply.matched_stop = message.finish_reason, message.matched_stop
                reply.usage.CopyFrom(message.usage)
                reply.timings.CopyFrom(message.timings)
        return reply

    async def _generate(self, request, context):
        arrival = time.monotonic()
        prepared = prepare(request, self.tokenizer, self.limits, self.model_name)
        request_id = prepared.request.request_id
        text_stream = TextStream(self.tokenizer, prepared.request.prompt_token_ids, prepared.stop)
        call = self.scheduler.submit(codec.submit_request_to_proto(prepared.request), context.time_remaining())
        first_token = None
        finished = False
        try:
            async for delta in call:
                out = generation_pb2.GenerateStreamResponse(request_id=request_id, token_ids=delta.new_token_ids)
                if delta.new_token_ids and first_token is None:
                    first_token = time.monotonic()
                out.text = text_stream.push(list(delta.new_token_ids))
                self._add_logprobs(out, delta)
                if text_stream.stopped or delta.finished:
                    finished = True
                    if text_stream.stopped and not delta.finished:
                        await self.scheduler.abort([request_id], common_pb2.FINISH_REASON_STOP)
                    out.text += text_stream.finish()
                    self._finish(out, delta, text_stream, arrival, first_token)
                    yield out
                    return
                yield out
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE:
                raise Unavailable(f"scheduler at {self.scheduler.address} is unavailable: {error.details()}")
            raise
        finally:
            if not finished:  # the client cancelled or went away: the scheduler frees the pages
                call.cancel()

    def _add_logprobs(self, out: generation_pb2.GenerateStreamResponse, delta) -> None:
        for token_id, entry in zip(delta.new_token_ids, delta.logprobs):
            logprob = out.logprobs.add(token_id=token_id, token=self.tokenizer.decode([token_id], False),
                                       logprob=entry.logprob)
            for top_id, top_logprob in zip(entry.top_token_ids, entry.top_logprobs):
                logprob.top_logprobs.add(token_id=top_id, token=self.tokenizer.decode([top_id], False),
                                         logprob=top_logprob)

    @staticmethod
    def _finish(out, delta, text_stream: TextStream, arrival: float, first_token: float | None) -> None:
        now = time.monotonic()
        out.finish_reason = common_pb2.FINISH_REASON_STOP if text_stream.stopped else delta.finish_reason
        out.matched_stop = text_stream.matched_stop
        out.usage.prompt_tokens = delta.num_prompt_tokens
        out.usage.completion_tokens = delta.num_output_tokens
        out.usage.cached_prompt_tokens = delta.num_cached_tokens
        out.timings.queue_ns = delta.timings.queue_ns
        out.timings.time_to_first_token_ns = int(((first_token or now) - arrival) * 1e9)
        out.timings.decode_ns = int((now - (first_token or now)) * 1e9)
        out.timings.e2e_ns = int((now - arrival) * 1e9)

    async def Tokenize(self, request, context):
        ids = prompt_token_ids(request, self.tokenizer, self.limits, request.add_special_tokens)
        return generation_pb2.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request, context):
        from gateway.validation import validate_prompt_ids

        validate_prompt_ids(list(request.token_ids), self.limits)
        return generation_pb2.DetokenizeResponse(
            text=self.tokenizer.decode(list(request.token_ids), request.skip_special_tokens))

    async def GetModelInfo(self, request, context):
        return self.model_info

    async def GetRequestStatus(self, request, context):
        if self.state_reader is None:
            raise Unavailable("request status needs Redis; this gateway runs without --redis-url")
        record = await self.state_reader.get_record(request.request_id)
        if record is None:
            raise NotFound("request", request.request_id)
        return self._status_reply(record)

    async def CancelRequest(self, request, context):
        aborted = await self.scheduler.abort([request.request_id])
        status = generation_pb2.REQUEST_STATUS_CANCELLED if aborted else generation_pb2.REQUEST_STATUS_UNSPECIFIED
        if not aborted and self.state_reader is not None:
            record = await self.state_reader.get_record(request.request_id)
            if record is None:
                raise NotFound("request", request.request_id)
            status = _STATUS[record.status]
        return generation_pb2.CancelRequestResponse(cancelled=bool(aborted), status=status)

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
