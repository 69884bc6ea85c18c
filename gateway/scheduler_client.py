"""The gateway's side of the gateway -> scheduler hop."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.errors import ServingError
from gateway.circuit_breaker import CircuitBreaker
from protos.tokenmill.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from plumbing import tls as tls_config
from plumbing.message_size import INTERNAL_MAX_MESSAGE_BYTES, message_size_options
from plumbing.rpc import SCHEDULER_SERVICE

logger = logging.getLogger(__name__)
# A restarted scheduler is found within a second, not after gRPC's default reconnect backoff (up to 120 s).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)]


class FailureHandling:
    """What the generation paths need beside submit/abort, shared by SchedulerClient and ReplicaRouter:
    where a request goes (route), the lost-request callback and aborts that nobody waits for.

    route(prompt_token_ids) returns the target of one call: something with .address, .breaker (the
    circuit breaker of that scheduler: each replica has its own, so one dead replica never refuses
    calls that would go to a live one) and .submit(request, timeout_s)."""

    # (request_id, error, accepted): a request whose scheduler stream broke; the gateway ends its record
    on_request_lost: Callable[[str, ServingError, bool], None] | None
    _background: set[asyncio.Task]
    # set by the gateway before it stops its server: calls cancelled by that are not client cancels,
    # and resumable requests must keep running for a client to resume them on another gateway
    shutting_down: bool = False

    def route(self, prompt_token_ids):
        raise NotImplementedError

    async def abort(self, request_ids: list[str], reason: int = common_pb2.FINISH_REASON_ABORT) -> list[str]:
        raise NotImplementedError

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
            await self.abort([request_id])
        except grpc.aio.AioRpcError as error:
            logger.warning("abort of %r failed: %s", request_id, error.details())
        except Exception as error:  # e.g. the channel closed under it while the gateway stops
            logger.warning("abort of %r failed: %r", request_id, error)


class SchedulerClient(FailureHandling):
    def __init__(self, address: str, breaker: CircuitBreaker | None = None,
                 on_request_lost: Callable[[str, ServingError, bool], None] | None = None, *,
                 tls: tls_config.ClientTLS | None = None,
                 max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES) -> None:
        self.address = address
        self.breaker = breaker or CircuitBreaker(f"scheduler at {address}")
        self.on_request_lost = on_request_lost
        self._background: set[asyncio.Task] = set()
        self._channel = tls_config.aio_channel(
            address, tls, message_size_options(max_message_bytes) + RECONNECT_OPTIONS)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

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

    def route(self, prompt_token_ids) -> SchedulerClient:
        return self  # one scheduler: every call goes to it, guarded by its breaker

    def submit(self, request: scheduler_pb2.SubmitRequest, timeout_s: float | None = None):
        """A streaming call; iterate it for SubmitResponses, cancel() it to abort the request."""
        return self.stub.Submit(request, timeout=timeout_s)

    async def abort(self, request_ids: list[str], reason: int = common_pb2.FINISH_REASON_ABORT) -> list[str]:
        reply = await self.stub.Abort(scheduler_pb2.AbortRequest(request_ids=request_ids, reason=reason),
                                      timeout=5.0)
        return list(reply.aborted_request_ids)

    async def close(self) -> None:
        await self._channel.close()
