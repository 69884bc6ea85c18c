"""The gateway's side of the gateway -> scheduler hop: typed values in, typed values out.

    outputs = client.submit(request, deadline_unix_s=..., resumable=False, owner="alice", timeout_s=30)
    async with contextlib.aclosing(outputs):
        async for output in outputs:        # core.outputs.RequestOutput, the last one finished
            ...
    await client.abort(["id"], FinishReason.STOP)

A refused or failed call raises the core.errors type its status stands for (InvalidArgument,
ResourceExhausted with the scheduler's retry hint, AlreadyExists, Unavailable, DeadlineExceeded, ...);
closing the iterator early cancels the call, which aborts the request in the scheduler. Protobuf
stays in here and in protos.codec.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.outputs import FinishReason, RequestOutput
from core.requests import GenerationRequest
from gateway.upstream.circuit_breaker import BreakerState, CircuitBreaker
from gateway.upstream.delta_stream import DeltaReader, FromSubmit, SubmitEnded, in_order
from plumbing.rpc import error_from_rpc_error
from plumbing.telemetry.tracing import RequestContexts
from protos import codec
from protos.tokenmill.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from plumbing import tls as tls_config
from plumbing.internal_secret import aio_channel_with_secret
from plumbing.message_size import INTERNAL_MAX_MESSAGE_BYTES, message_size_options
from plumbing.rpc import SCHEDULER_SERVICE

logger = logging.getLogger(__name__)
# A restarted scheduler is found within a second, not after gRPC's default reconnect backoff (up to 120 s).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)]
# While the breaker is open, how often the scheduler's readiness is checked (each check also waits
# up to this long for the channel to reconnect), so a restarted scheduler is used again at once.
READINESS_POLL_S = 0.2


@dataclass(slots=True, frozen=True)
class SchedulerLoad:
    num_requests: int  # waiting + running
    kv_usage: float  # pages used / pages in all


class SchedulerClient:
    """One scheduler: a gateway.upstream.target.SchedulerTarget that is its own Route."""

    def __init__(self, address: str, breaker: CircuitBreaker | None = None, *,
                 tls: tls_config.ClientTLS | None = None,
                 max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES, delta_stream: bool = True,
                 internal_secret: str | None = None) -> None:
        """delta_stream: requests' tokens come batched per step on one StreamDeltas call (gateway.upstream.delta_stream)
        rather than each on its own Submit call. internal_secret: sent with every call
        (plumbing.internal_secret); None: none."""
        self.address = address
        self.breaker = breaker or CircuitBreaker(f"scheduler at {address}")
        self.breaker.on_open = self._watch_readiness_while_open
        self._readiness_watch: asyncio.Task | None = None
        self._channel = aio_channel_with_secret(
            address, tls, message_size_options(max_message_bytes) + RECONNECT_OPTIONS, secret=internal_secret)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._deltas = DeltaReader(self.stub, address) if delta_stream else None
        self._request_contexts = RequestContexts()  # for a cancel's span to link to the request it ends

    async def wait_ready(self, timeout_s: float) -> common_pb2.GetModelInfoResponse:
        """Waits until the scheduler reports ready (its worker registered); returns the model info."""
        check = health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE)
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    reply = await self._health.Check(check, timeout=5.0, wait_for_ready=True)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return await self.stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10.0)
                except grpc.aio.AioRpcError as error:
                    if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise
                await asyncio.sleep(0.25)

    async def is_ready(self, timeout_s: float = 2.0) -> bool:
        """One readiness check (no waiting for the connection): SERVING now or not."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def _watch_readiness_while_open(self) -> None:
        """The breaker just opened: close it as soon as the scheduler reports SERVING again (a
        half-open probe alone lets one call through per open_s, refusing the rest meanwhile)."""
        if self._readiness_watch is None or self._readiness_watch.done():
            self._readiness_watch = asyncio.get_running_loop().create_task(
                self._close_breaker_when_ready(), name=f"breaker-readiness-{self.address}")

    async def _close_breaker_when_ready(self) -> None:
        check = health_pb2.HealthCheckRequest(service=SCHEDULER_SERVICE)
        while self.breaker.state is not BreakerState.CLOSED:
            try:
                # wait_for_ready: the check goes out the moment the channel reconnects
                reply = await self._health.Check(check, timeout=READINESS_POLL_S, wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    self.breaker.record_ready()
                    logger.info("scheduler at %s reports SERVING: circuit closed", self.address)
                    return
            except grpc.aio.AioRpcError:
                pass  # still down or restarting
            await asyncio.sleep(READINESS_POLL_S)

    def route(self, prompt_token_ids: Sequence[int]) -> SchedulerClient:
        return self  # one scheduler: every call goes to it, guarded by its breaker

    async def submit(self, request: GenerationRequest, *, deadline_unix_s: float | None = None,
                     resumable: bool = False, owner: str | None = None,
                     timeout_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the scheduler streams them; leaving early cancels the call.

        deadline_unix_s: the scheduler ends the request (and frees its pages) itself when it passes.
        resumable: the scheduler keeps it running if this gateway goes away (gateway.generation.resume).
        owner: the API key name that sent it, recorded with the request."""
        message = codec.submit_request_to_proto(request, deadline_unix_s, resumable=resumable, owner=owner)
        queue: asyncio.Queue = asyncio.Queue()
        request_id = request.request_id
        self._request_contexts.note(request_id)  # forgotten as the call ends (both finally blocks)
        if self._deltas is not None:
            message.delta_stream_id = self._deltas.bind(request_id, queue)
        call = self.stub.Submit(message, timeout=timeout_s)
        if not message.delta_stream_id:
            try:
                async for response in call:
                    yield codec.request_output_from_proto(response)
            except grpc.aio.AioRpcError as error:
                raise error_from_rpc_error(error) from error
            finally:
                call.cancel()  # a no-op once the call has ended; otherwise the scheduler aborts the request
                self._request_contexts.forget(request_id)
            return
        pump = asyncio.get_running_loop().create_task(_pump(call, queue))
        try:
            async for output in in_order(queue, request_id):
                yield output
        finally:
            call.cancel()
            pump.cancel()
            self._deltas.unbind(request_id, queue)
            self._request_contexts.forget(request_id)

    async def abort(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> list[str]:
        """Ends the requests in the scheduler with reason; returns the ids it still had."""
        message = scheduler_pb2.AbortRequest(request_ids=request_ids, reason=codec.finish_reason_to_proto(reason))
        self._request_contexts.link_current_span(request_ids)  # a CancelRequest's span -> the request's
        try:
            reply = await self.stub.Abort(message, timeout=5.0)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc_error(error) from error
        return list(reply.aborted_request_ids)

    async def get_load(self, timeout_s: float = 2.0) -> SchedulerLoad:
        try:
            load = await self.stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc_error(error) from error
        total = load.num_kv_pages_total
        return SchedulerLoad(load.num_waiting_requests + load.num_running_requests,
                             load.num_kv_pages_used / total if total else 0.0)

    async def close(self) -> None:
        if self._readiness_watch is not None:
            self._readiness_watch.cancel()
        if self._deltas is not None:
            await self._deltas.close()
        await self._channel.close()


async def _pump(call, queue: asyncio.Queue) -> None:
    """A Submit call's messages into the request's queue, beside its delta stream's."""
    try:
        async for response in call:
            queue.put_nowait(FromSubmit(codec.request_output_from_proto(response)))
    except grpc.aio.AioRpcError as error:
        typed = error_from_rpc_error(error)
        typed.__cause__ = error
        queue.put_nowait(SubmitEnded(typed))
    else:
        queue.put_nowait(SubmitEnded())
