"""tokenmill.v1.Scheduler servicer: protobuf in, one call into the process (the EngineLoop, or
scheduler.process.submissions for a Submit call), protobuf out."""
from __future__ import annotations

from core.errors import InvalidArgument, PermissionDenied, Unavailable
from core.outputs import FinishReason, RequestOutput
from plumbing import peer_roles
from protos import codec
from protos.tokenmill.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from scheduler.process.loop import EngineLoop
from scheduler.process.submissions import Submission, follow
from scheduler.process.telemetry import link_cancelled


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self._loop: EngineLoop | None = None
        self.model_info: common_pb2.GetModelInfoResponse | None = None  # from the worker's capacity

    def attach(self, loop: EngineLoop, model_info: common_pb2.GetModelInfoResponse) -> None:
        self._loop, self.model_info = loop, model_info

    @property
    def loop(self) -> EngineLoop:
        if self._loop is None:
            raise Unavailable("scheduler is starting: its worker has not registered yet")
        return self._loop

    async def Submit(self, request, context):
        roles = peer_roles.current_roles()  # None: callers are not told apart (no mutual TLS, loopback)
        if request.owner and roles is not None and "gateway" not in roles:
            # the owner decides who may read and cancel a request by id: only a gateway vouches for one
            raise PermissionDenied(f"SubmitRequest.owner={request.owner!r}: only a caller whose certificate "
                                   "names the gateway role may set owner")
        loop = self.loop  # Unavailable until the worker registered
        submission = Submission(codec.generation_request_from_submit_proto(request),
                                codec.deadline_from_submit_proto(request), request.resumable,
                                owner=request.owner or None, delta_stream_id=request.delta_stream_id)

        # context.write, not yield: a call cut while a message is being sent (a deadline, the gateway
        # gone) then raises inside follow(), so its clean-up runs at once under the call's live span; a
        # generator suspended at its yield is only closed when garbage-collected, in another task,
        # after its span has ended
        async def send(output: RequestOutput) -> None:
            await context.write(codec.request_output_to_proto(output))

        await follow(loop, submission, send, context.time_remaining)

    async def StreamDeltas(self, request, context):
        if not request.stream_id:
            raise InvalidArgument("StreamDeltasRequest.stream_id", "", "must be set (the id the gateway's "
                                  "SubmitRequest.delta_stream_id names)")
        deltas = self.loop.streams.delta_streams.open(request.stream_id)  # AlreadyExists for an open id
        try:
            while True:
                batch = await deltas.next_batch()
                await context.write(codec.step_deltas_to_proto(batch, columns=request.columns))
        finally:  # the gateway cancelled it (or went away): its requests' deltas go to their Submit calls
            self.loop.streams.delta_streams.close(deltas)

    async def Abort(self, request, context):
        reason = codec.finish_reason_from_proto(request.reason) or FinishReason.ABORT
        aborted = [rid for rid in request.request_ids if self.loop.abort(rid, finish_reason=reason)]
        link_cancelled(filter(None, map(self.loop.scheduler.requests.get, aborted)))
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
