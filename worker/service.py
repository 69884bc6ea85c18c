"""tokenmill.v1.Worker servicer: protobuf in, one call into the ModelRunner, protobuf out."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from protos import codec
from protos.tokenmill.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from core.errors import FailedPrecondition, Unavailable
from worker.model.config import ModelConfig
from worker.model_runner import ModelRunner, PlanMismatchError
from worker.step_order import StepOrder
from worker.step_telemetry import StepTelemetry


def model_config_to_proto(config: ModelConfig, name: str, dtype: str, quantization: str = "none") -> common_pb2.ModelConfig:
    """quantization: what the linears run in (worker.linears.group_quant.weight_formats); "" / "none": floats."""
    return common_pb2.ModelConfig(
        name=name, architecture=config.architecture, vocab_size=config.vocab_size,
        max_context_length=config.max_position_embeddings, num_layers=config.num_layers,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rope_theta=config.rope_theta, eos_token_id=config.eos_token_id, bos_token_id=config.bos_token_id,
        dtype=dtype, quantization="" if quantization == "none" else quantization,
        sliding_window=config.every_layer_window or 0)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.capacity: worker_pb2.GetCapacityResponse | None = None
        self.runner: ModelRunner | None = None  # set once the model is loaded and warmed up
        self.num_steps = 0
        self.step_telemetry = StepTelemetry()  # one span per step, linked to its requests; step time
        # One step at a time, always on the same thread: the forward pass leaves the event loop free
        # for health checks, and OpenMP keeps one warm thread team (a team belongs to the thread
        # that calls into torch, so a pool handing steps to different threads would build several).
        # Steps are also taken in step-id order: with async scheduling step N+1 arrives while N runs.
        self._step_order = StepOrder()
        self._compute_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")

    async def run_compute(self, fn, *args):
        """Runs fn on the compute thread (model loading and warm-up too, so they warm the same team)."""
        return await asyncio.get_running_loop().run_in_executor(self._compute_thread, fn, *args)

    def attach(self, runner: ModelRunner, capacity: worker_pb2.GetCapacityResponse) -> None:
        self.runner, self.capacity = runner, capacity

    def _ready_runner(self) -> ModelRunner:
        if self.runner is None:
            raise Unavailable("worker is loading its model")
        return self.runner

    async def GetCapacity(self, request, context):
        self._ready_runner()
        return self.capacity

    async def ExecuteStep(self, request, context):
        runner = self._ready_runner()
        plan = codec.step_plan_from_proto(request)
        try:  # prepared on this thread, while the compute thread may still run the previous step
            async with self._step_order.turn(plan.step_id, lambda: runner.prepare(plan)) as prepared:
                with self.step_telemetry.step(plan) as step:
                    result = step.result = await self.run_compute(runner.run, prepared)
        except PlanMismatchError as error:
            raise FailedPrecondition(str(error)) from error
        self.num_steps += 1
        return codec.step_result_to_proto(result, columns=bool(request.batch_request_ids))

    async def Health(self, request, context):
        return worker_pb2.HealthResponse(ready=self.runner is not None, num_steps_executed=self.num_steps,
                                         num_requests=len(self.runner.requests) if self.runner else 0,
                                         num_steps_queued=self._step_order.num_steps_queued)
