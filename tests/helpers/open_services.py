"""What an internal server keeps open to any caller it lets connect, whatever else it refuses: gRPC
health and reflection (probes and grpcurl need no secret and no role)."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc


async def assert_health_and_reflection_answer(channel: grpc.aio.Channel, service: str) -> None:
    """Health says SERVING and reflection lists service, over channel."""
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    listed = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    async for answer in listed:
        assert service in [s.name for s in answer.list_services_response.service]
