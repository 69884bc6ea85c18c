"""tokenmill.v1.Scheduler servicer: protobuf in, one call into the EngineLoop, protobuf out."""
from __future__ import annotations

import asyncio

from core.errors import DrainTimeout, InvalidArgument, PermissionDenied, Unavailable
from plumbing import peer_roles
from core.outputs import FinishReason, RequestTimings, coalesce
from protos import codec
from protos.tokenmill.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler.process.loop import EngineLoop
from scheduler.request import Request
from scheduler.process.request_streams import RequestTimes
from scheduler.process.telemetry import (CLIENT_DISCONNECT, finish_cause, record_deadline_cut, record_request_end,
                                 start_request)

# A call cut this close to its deadline was cut by it: by gRPC here, or by the gateway, which drops the
# call when its own client's deadline passes, a few milliseconds before this call's (sent as the time
# left when the gateway made the call)
DEADLINE_SLACK_S = 0.05


def _timings(times: RequestTimes) -> RequestTimings:
    def ns(start: float | None, end: float | None) -> int:
        return int((end - start) * 1e9) if start is not None and end is not None else 0

    return RequestTimings(queue_ns=ns(times.arrival, times.first_scheduled),
                          time_to_first_token_ns=ns(times.arrival, times.first_token),
                          decode_ns=ns(times.first_token, times.finished), e2e_ns=ns(times.arrival, times.finished),
                          first_token_forward_ns=times.first_token_forward_ns)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self._loop: EngineLoop | None = None
        self.model_info = None  # common_pb2.GetModelInfoResponse, from the worker's capacity

    def attach(self, loop: EngineLoop, model_info: common_pb2.GetModelInfoResponse) -> None:
        self._loop, self.model_info = loop, model_info

    @property
    def loop(self) -> EngineLoop:
        if self._loop is None:
            raise Unavailable("scheduler is starting: its worker has not registered yet")
        return self._loop

    async def Submit(self, request, context):
        # context.write, not yield: a call cut while a message is being sent (a deadline, the gateway
        # gone) then raises here, so the clean-up below runs at once under the call's live span; a
        # generator suspended at its yield is only closed when garbage-collected, in another task,
        # after its span has ended
        roles = peer_roles.current_roles()  # None: callers are not told apart (no mutual TLS, loopback)
        if request.owner and roles is not None and "gateway" not in roles:
            # the owner decides who may read and cancel a request by id: only a gateway vouches for one
            raise PermissionDenied(f"SubmitRequest.owner={request.owner!r}: only a caller whose certificate "
                                   "names the gateway role may set owner")
        # a resumable request outlives this call (its gateway may die): its caller aborts it explicitly
        resumable = request.resumable and self.loop.tokens is not None
        # worker step spans link to this call's span through the request's trace context
        domain_request = Request.from_generation_request(codec.generation_request_from_submit_proto(request),
                                                         trace_context=start_request(request.request_id))
        stream = self.loop.submit(domain_request, codec.deadline_from_submit_proto(request), resumable,
                                  owner=request.owner or None, delta_stream_id=request.delta_stream_id)
        finished = False
        first = True
        try:
            while not finished:
                output = await stream.queue.get()
                # coalesce deltas that piled up while this client was slow to read; only adjacent ones
                # (with a delta stream, the deltas between the first and the last went there)
                while not output.finished and not stream.queue.empty() and _adjacent(output, stream.queue):
                    output = coalesce(output, stream.queue.get_nowait())
                if first or output.finished:
                    # GetRequestStatus (answered from Redis) must know the id by the time the client
                    # has its first message, and know how it ended by the time it has the last
                    first = False
                    await self.loop.streams.recorded(request.request_id)
                finished = output.finished
                if finished:  # an error ending reads "error" whatever the reason beside it (a deadline's is abort)
                    reason = FinishReason.ERROR if output.error is not None else output.finish_reason
                    record_request_end(stream.times, output.num_preemptions, reason, finish_cause(output.error))
                    output.timings = _timings(stream.times)
                if output.error is not None:  # typed: the edge maps it to its status (plumbing.rpc)
                    raise output.error
                await context.write(codec.request_output_to_proto(output))
        finally:
            remaining_s = context.time_remaining()
            if not finished and remaining_s is not None and remaining_s <= DEADLINE_SLACK_S:
                record_deadline_cut(stream.times, request.request_id)
            elif not finished and stream.abort_reason is not None:  # dropped after asking for the abort
                record_request_end(stream.times, finish_reason=stream.abort_reason)
            elif not finished:  # the gateway dropped the call: its client went away (or the gateway did)
                record_request_end(stream.times, finish_reason=FinishReason.ABORT, cause=CLIENT_DISCONNECT)
            if not finished and not resumable:  # the client went away or cancelled: free its pages
                self.loop.abort(request.request_id)
            elif not finished:  # runs on for a client to resume by id; an orphan if none does (scheduler.process.orphans)
                self.loop.streams.detach(request.request_id)

    async def StreamDeltas(self, request, context):
        if not request.stream_id:
            raise InvalidArgument("StreamDeltasRequest.stream_id", "", "must be set (the id the gateway's "
                                  "SubmitRequest.delta_stream_id names)")
        deltas = self.loop.streams.delta_streams.open(request.stream_id)  # AlreadyExists for an open id
        try:
            while True:
                batch = await deltas.next_batch()
                await context.write(scheduler_pb2.StepDeltas(deltas=[codec.request_output_to_proto(o) for o in batch]))
        finally:  # the gateway cancelled it (or went away): its requests' deltas go to their Submit calls
            self.loop.streams.delta_streams.close(deltas)

    async def Abort(self, request, context):
        reason = codec.finish_reason_from_proto(request.reason) or FinishReason.ABORT
        aborted = [rid for rid in request.request_ids if self.loop.abort(rid, finish_reason=reason)]
        return scheduler_pb2.AbortResponse(aborted_request_ids=aborted)

    async def GetLoad(self, request, context):
        stats = self.loop.scheduler.stats()
        reply = scheduler_pb2.GetLoadResponse(
            num_waiting_requests=stats.num_waiting, num_running_requests=stats.num_running,
            num_waiting_tokens=stats.num_waiting_tokens, num_kv_pages_total=stats.num_blocks,
            num_kv_pages_used=stats.num_used_blocks, num_kv_pages_free=stats.num_blocks - stats.num_used_blocks,
            kv_utilization=stats.kv_utilization,
            prefix_cache_hit_rate=stats.prefix_cache_hits / stats.prefix_cache_queries
            if stats.prefix_cache_queries else 0.0,
            num_preemptions_total=stats.num_preemptions, step_token_budget=stats.token_budget,
            itl_target_headroom=stats.itl_target_headroom, num_itl_target_misses_total=stats.num_itl_target_misses)
        if request.include_running_request_ids:
            reply.running_request_ids.extend(r.request_id for r in self.loop.scheduler.running)
        return reply

    async def GetModelInfo(self, request, context):
        self.loop  # noqa: B018 - raises Unavailable until the worker registered
        return self.model_info


def _adjacent(output, queue: asyncio.Queue) -> bool:
    """Whether the next queued output's tokens follow output's with none between."""
    more = queue._queue[0]  # noqa: SLF001 - asyncio.Queue has no peek
    return more.num_output_tokens - len(more.new_token_ids) == output.num_output_tokens


async def drain(loop: EngineLoop, timeout_s: float, drain_timeout_s: float) -> None:
    """Waits for in-flight requests to finish (graceful shutdown), at most timeout_s; then ends the
    calls of those left with DrainTimeout (UNAVAILABLE, recorded as ended by the drain), rather than
    leaving them to be cut by the server's stop, which reads as their gateway gone. The requests stay
    as they are: a resumable one runs on in the scheduler that restarts here (scheduler.process.readmission).
    drain_timeout_s: the whole drain's, for the message."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while loop.streams and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    loop.streams.cut(lambda request_id: DrainTimeout(
        f"the scheduler shut down before request {request_id!r} finished (its drain timeout of "
        f"{drain_timeout_s:g}s passed)"))
