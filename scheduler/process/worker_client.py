"""The scheduler's side of the scheduler -> worker hop: an AsyncExecutor over gRPC."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import codec
from protos.tokenmill.v1 import worker_pb2, worker_pb2_grpc
from core.step import StepPlan, StepResult
from plumbing import tls as tls_config
from plumbing.internal_secret import aio_channel_with_secret
from plumbing.message_size import INTERNAL_MAX_MESSAGE_BYTES, message_size_options
from plumbing.rpc import WORKER_SERVICE, error_from_rpc_error
from scheduler.process.worker_recovery import WorkerPages

# A restarted worker is found within a second, not after gRPC's default reconnect backoff (up to 120 s).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)]


class WorkerClient:
    def __init__(self, address: str, step_timeout_s: float = 120.0, *, tls: tls_config.ClientTLS | None = None,
                 max_message_bytes: int = INTERNAL_MAX_MESSAGE_BYTES, internal_secret: str | None = None) -> None:
        """internal_secret: sent with every call (plumbing.internal_secret); None: none."""
        self.address = address
        self.step_timeout_s = step_timeout_s
        # step plans carry whole prompts of new requests (plumbing.message_size sizes the limit)
        self._channel = aio_channel_with_secret(
            address, tls, message_size_options(max_message_bytes) + RECONNECT_OPTIONS, secret=internal_secret)
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)
        self.capacity: worker_pb2.GetCapacityResponse | None = None
        self._watcher: asyncio.Task | None = None

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

    async def reconnect(self, timeout_s: float) -> WorkerPages:
        """Re-registers a worker that came back (after a crash): ready, and with the page size the
        scheduler was built for; returns its pages (the scheduler adopts a different count). Raises if
        it is not back within timeout_s or its pages hold another number of tokens."""
        known = self.capacity
        capacity = await self.register(timeout_s)
        if known is not None and capacity.block_size != known.block_size:
            self.capacity = known
            raise RuntimeError(f"worker at {self.address} came back with KV pages of {capacity.block_size} tokens; "
                               f"this scheduler was built for pages of {known.block_size}")
        return WorkerPages(capacity.num_blocks, capacity.num_host_blocks)

    def watch_connection(self, on_lost) -> None:
        """Calls on_lost() whenever a connection to the worker that was up breaks, even while no step
        is in flight: a worker restarted behind an idle scheduler has an empty KV cache, so the
        scheduler must forget its prefix cache before it schedules again."""
        self._watcher = asyncio.get_running_loop().create_task(self._watch(on_lost), name="worker-connection")

    async def _watch(self, on_lost) -> None:
        ready = grpc.ChannelConnectivity.READY
        state = self._channel.get_state(try_to_connect=True)
        while True:
            await self._channel.wait_for_state_change(state)
            new_state = self._channel.get_state(try_to_connect=True)
            if state == ready and new_state != ready:
                on_lost()
            state = new_state

    def execute(self, plan: StepPlan) -> Awaitable[StepResult]:
        """Starts the ExecuteStep call now (its message goes out at the event loop's next turn, ahead of
        whatever the caller does first), and returns its result to await. That raises the typed error of
        the worker's status, its message naming this worker (it reaches the clients of the requests the
        step fails)."""
        try:
            columns = self.capacity is not None and self.capacity.columnar_steps  # False: an older worker
            call = self._stub.ExecuteStep(codec.step_plan_to_proto(plan, columns), timeout=self.step_timeout_s)
        except Exception as error:  # noqa: BLE001 - a step that cannot start fails like one that broke: when awaited
            return _raise(error)
        return self._result(call)

    async def _result(self, call: grpc.aio.UnaryUnaryCall) -> StepResult:
        try:
            reply = await call
        except grpc.aio.AioRpcError as error:
            raise error_from_rpc_error(error, f"ExecuteStep on worker {self.address}") from error
        return codec.step_result_from_proto(reply)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        await self._channel.close()


async def _raise(error: Exception) -> StepResult:
    raise error
