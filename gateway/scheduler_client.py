"""The gateway's side of the gateway -> scheduler hop."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.tokenmill.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from tokenmill import tls as tls_config
from tokenmill.message_size import INTERNAL_MAX_MESSAGE_BYTES, message_size_options
from tokenmill.rpc import SCHEDULER_SERVICE


class SchedulerClient:
    def __init__(self, address: str, *, tls: tls_config.ClientTLS | None = None,
                 max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES) -> None:
        self.address = address
        self._channel = tls_config.aio_channel(address, tls, message_size_options(max_message_bytes))
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

    def submit(self, request: scheduler_pb2.SubmitRequest, timeout_s: float | None = None):
        """A streaming call; iterate it for SubmitResponses, cancel() it to abort the request."""
        return self.stub.Submit(request, timeout=timeout_s)

    async def abort(self, request_ids: list[str], reason: int = common_pb2.FINISH_REASON_ABORT) -> list[str]:
        reply = await self.stub.Abort(scheduler_pb2.AbortRequest(request_ids=request_ids, reason=reason),
                                      timeout=5.0)
        return list(reply.aborted_request_ids)

    async def close(self) -> None:
        await self._channel.close()
