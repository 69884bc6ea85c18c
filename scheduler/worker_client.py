"""The scheduler's side of the scheduler -> worker hop: an AsyncExecutor over gRPC."""
from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import codec
from protos.tokenmill.v1 import worker_pb2, worker_pb2_grpc
from scheduler.plan import StepPlan, StepResult
from tokenmill import tls as tls_config
from tokenmill.message_size import INTERNAL_MAX_MESSAGE_BYTES, message_size_options
from tokenmill.rpc import WORKER_SERVICE


class WorkerClient:
    def __init__(self, address: str, step_timeout_s: float = 120.0, *, tls: tls_config.ClientTLS | None = None,
                 max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES) -> None:
        self.address = address
        self.step_timeout_s = step_timeout_s
        # step plans carry whole prompts of new requests (tokenmill.message_size sizes the limit)
        self._channel = tls_config.aio_channel(address, tls, message_size_options(max_message_bytes))
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self.capacity: worker_pb2.GetCapacityResponse | None = None

    @property
    def block_size(self) -> int:
        return self.capacity.block_size

    @property
    def num_blocks(self) -> int:
        return self.capacity.num_blocks

    async def register(self, timeout_s: float) -> worker_pb2.GetCapacityResponse:
        """Waits (up to timeout_s) until the worker reports ready, then learns its KV capacity."""
        health = health_pb2_grpc.HealthStub(self._channel)
        check = health_pb2.HealthCheckRequest(service=WORKER_SERVICE)
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    reply = await health.Check(check, timeout=5.0, wait_for_ready=True)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.aio.AioRpcError as error:
                    if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        raise
                await asyncio.sleep(0.25)  # still loading its model
        self.capacity = await self._stub.GetCapacity(worker_pb2.GetCapacityRequest(), timeout=10.0)
        return self.capacity

    async def execute(self, plan: StepPlan) -> StepResult:
        reply = await self._stub.ExecuteStep(codec.step_plan_to_proto(plan), timeout=self.step_timeout_s)
        return codec.step_result_from_proto(reply)

    async def close(self) -> None:
        await self._channel.close()
