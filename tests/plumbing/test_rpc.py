"""A real grpc.aio server in-process, with tiny servicers, through plumbing.rpc's plumbing."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from protos.tokenmill.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2, worker_pb2_grpc
from core import errors
from plumbing import rpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class TinyWorker(worker_pb2_grpc.WorkerServicer):
    """Each RPC fails in one way a real worker could."""

    def __init__(self) -> None:
        self.address = ""  # set once the port is known; used to call back into this server

    async def GetCapacity(self, request, context):
        raise errors.InvalidArgument("block_size", 0, "must be a power of two between 1 and 256")

    async def ExecuteStep(self, request, context):
        if request.step_id == 1:
            raise RuntimeError("KV cache tensor shape mismatch")
        # forwards to GetCapacity over gRPC, as the gateway forwards to the scheduler
        async with grpc.aio.insecure_channel(self.address) as channel:
            await worker_pb2_grpc.WorkerStub(channel).GetCapacity(worker_pb2.GetCapacityRequest())
        return worker_pb2.StepResult(step_id=request.step_id)

    async def Health(self, request, context):
        await context.abort(grpc.StatusCode.UNAVAILABLE, "warming up")


class TinyScheduler(scheduler_pb2_grpc.SchedulerServicer):
    async def Submit(self, request, context):
        yield scheduler_pb2.SubmitResponse(request_id=request.request_id, new_token_ids=[7])
        raise errors.ResourceExhausted("waiting queue is full (1024 requests)", retry_after_s=0.25)

    async def Abort(self, request, context):
        raise errors.NotFound("request", request.request_ids[0])

    async def StreamDeltas(self, request, context):
        """Writes once, then fails writing after its caller cancelled (as the scheduler's Submit may once
        the gateway closed the call on a stop string)."""
        try:
            await context.write(scheduler_pb2.StepDeltas())
            try:
                await asyncio.sleep(5)  # the caller cancels here
            except asyncio.CancelledError:
                pass  # as a handler whose write was already on its way when the cancel landed
            await context.write(scheduler_pb2.StepDeltas())  # fails: the call is over
        finally:
            self.stream_ended.set()


@pytest.fixture
async def served():
    server = rpc.create_server()
    worker = TinyWorker()
    worker_pb2_grpc.add_WorkerServicer_to_server(worker, server)
    scheduler = TinyScheduler()
    scheduler.stream_ended = asyncio.Event()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(scheduler, server)
    health = rpc.add_health_and_reflection(server, [rpc.WORKER_SERVICE, rpc.SCHEDULER_SERVICE])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    worker.address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(worker.address)
    try:
        TinyScheduler.last = scheduler  # for a test that waits on its handler
        yield worker.address, channel, health
    finally:
        await channel.close()
        await server.stop(grace=None)


async def check(channel, service: str):
    return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service))).status


async def test_liveness_serves_at_once_and_readiness_flips_on_set_ready(served):
    _, channel, health = served
    assert await check(channel, "") == SERVING
    assert await check(channel, rpc.WORKER_SERVICE) == NOT_SERVING
    assert await check(channel, rpc.SCHEDULER_SERVICE) == NOT_SERVING

    await health.set_ready()
    assert await check(channel, rpc.WORKER_SERVICE) == SERVING
    assert await check(channel, rpc.SCHEDULER_SERVICE) == SERVING

    await health.set_ready(False)
    assert await check(channel, rpc.WORKER_SERVICE) == NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as unknown:
        await check(channel, "tokenmill.v1.Nope")
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_graceful_shutdown_turns_everything_not_serving(served):
    _, channel, health = served
    await health.set_ready()
    await health.enter_graceful_shutdown()
    await health.set_ready()  # too late: shutdown wins
    assert await check(channel, "") == NOT_SERVING
    assert await check(channel, rpc.WORKER_SERVICE) == NOT_SERVING


async def test_reflection_lists_services_and_resolves_their_messages(served):
    address, _, _ = served

    def reflect():
        # the reflection client is synchronous: run it off the event loop that serves it
        with grpc.insecure_channel(address) as channel:
            database = ProtoReflectionDescriptorDatabase(channel)
            services = set(database.get_services())
            step_plan_file = database.FindFileContainingSymbol("tokenmill.v1.StepPlan")
            return services, step_plan_file

    services, step_plan_file = await asyncio.to_thread(reflect)
    assert services == {
        "tokenmill.v1.Worker",
        "tokenmill.v1.Scheduler",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }
    assert step_plan_file.name == "protos/tokenmill/v1/worker.proto"
    assert "StepPlan" in [message.name for message in step_plan_file.message_type]


def test_service_name_constants_match_the_protos():
    from protos.tokenmill.v1 import generation_pb2

    assert rpc.GENERATION_SERVICE == generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    assert rpc.SCHEDULER_SERVICE == scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
    assert rpc.WORKER_SERVICE == worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


async def test_invalid_argument_reaches_the_client_with_its_message(served):
    _, channel, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await worker_pb2_grpc.WorkerStub(channel).GetCapacity(worker_pb2.GetCapacityRequest())
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert failure.value.details() == "invalid block_size=0: must be a power of two between 1 and 256"


async def test_stream_keeps_its_messages_then_ends_with_the_mapped_status(served):
    _, channel, _ = served
    call = scheduler_pb2_grpc.SchedulerStub(channel).Submit(scheduler_pb2.SubmitRequest(request_id="r-1"))
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        async for response in call:
            received.append(list(response.new_token_ids))
    assert received == [[7]]
    assert failure.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert failure.value.details() == "waiting queue is full (1024 requests)"
    assert ("retry-after-ms", "250") in tuple(failure.value.trailing_metadata())


async def test_not_found_names_the_request(served):
    _, channel, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await scheduler_pb2_grpc.SchedulerStub(channel).Abort(scheduler_pb2.AbortRequest(request_ids=["r-404"]))
    assert (failure.value.code(), failure.value.details()) == (grpc.StatusCode.NOT_FOUND, "request 'r-404' not found")


async def test_unexpected_exception_is_internal_with_its_text_and_logged(served, caplog):
    _, channel, _ = served
    with caplog.at_level(logging.ERROR, logger="plumbing.rpc"):
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await worker_pb2_grpc.WorkerStub(channel).ExecuteStep(worker_pb2.StepPlan(step_id=1))
    assert failure.value.code() == grpc.StatusCode.INTERNAL
    assert failure.value.details() == "RuntimeError: KV cache tensor shape mismatch"
    logged = [record for record in caplog.records if "/tokenmill.v1.Worker/ExecuteStep" in record.getMessage()]
    assert logged and logged[0].exc_info is not None


async def test_downstream_status_passes_through_not_internal(served):
    _, channel, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await worker_pb2_grpc.WorkerStub(channel).ExecuteStep(worker_pb2.StepPlan(step_id=2))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid block_size=0" in failure.value.details()


async def test_handler_abort_passes_through_unchanged(served):
    _, channel, _ = served
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await worker_pb2_grpc.WorkerStub(channel).Health(worker_pb2.HealthRequest())
    assert (failure.value.code(), failure.value.details()) == (grpc.StatusCode.UNAVAILABLE, "warming up")


def test_error_messages_name_field_value_and_limit():
    error = errors.InvalidArgument("prompt", "x" * 1000, "4096 tokens is over max_context_length 2048")
    assert str(error).startswith("invalid prompt='xxx")
    assert str(error).endswith("... (1002 chars): 4096 tokens is over max_context_length 2048")
    assert rpc.status_for(error) == (grpc.StatusCode.INVALID_ARGUMENT, str(error))


def test_errors_about_one_named_thing_say_which_thing_and_what_the_client_can_use_instead():
    assert str(errors.NotFound("request", "r-1")) == "request 'r-1' not found"
    assert str(errors.AlreadyExists("request", "r-1")) == "request 'r-1' is already queued or running"
    assert str(errors.NotFound("version", "2", "model 'm' has version '1' only")) == \
        "version '2' not found; model 'm' has version '1' only"
    unknown = errors.UnknownModel("gpt-4", "SmolLM2", " (GET /v1/models)")
    assert str(unknown) == "model 'gpt-4' not found; this server serves 'SmolLM2' (GET /v1/models)"
    assert (unknown.kind, unknown.key, rpc.status_for(unknown)) == ("model", "gpt-4", (grpc.StatusCode.NOT_FOUND,
                                                                                       str(unknown)))
    # read back from storage: the class of its kind, the message as it was
    assert str(errors.error_from_code(errors.ErrorCode.NOT_FOUND, str(unknown))) == str(unknown)


@pytest.mark.parametrize("method, raw, reason", [
    ("/tokenmill.v1.Worker/GetCapacity", b"\xff\xff\xff", "Wire format was corrupt"),
    # field 1 (request_id, a string) holding the two bytes C3 28: not UTF-8
    ("/tokenmill.v1.Scheduler/Submit", b"\x0a\x02\xc3\x28", "bad UTF-8"),
])
async def test_undecodable_bytes_are_invalid_argument_naming_the_message_not_unknown(served, method, raw, reason):
    _, channel, _ = served
    identity = dict(request_serializer=lambda data: data, response_deserializer=lambda data: data)
    call = (channel.unary_stream if method.endswith("Submit") else channel.unary_unary)(method, **identity)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        if method.endswith("Submit"):
            async for _ in call(raw):
                pass
        else:
            await call(raw)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a valid protobuf message" in failure.value.details()
    assert reason in failure.value.details() and "tokenmill.v1." in failure.value.details()
    assert "<class" not in failure.value.details()


async def test_a_failure_after_the_caller_cancelled_is_no_counted_error(served, caplog):
    """The caller left first: nobody reads a status, and the call did not fail for its caller, so no
    error is counted or logged (without the check it counted and logged INTERNAL)."""
    from plumbing.telemetry.metrics import REQUEST_ERRORS

    _, channel, _ = served
    before = sum(sample.value for metric in REQUEST_ERRORS.collect() for sample in metric.samples
                 if sample.name.endswith("_total"))
    with caplog.at_level(logging.DEBUG, logger="plumbing.rpc"):
        call = scheduler_pb2_grpc.SchedulerStub(channel).StreamDeltas(scheduler_pb2.StreamDeltasRequest(stream_id="s"))
        await call.read()
        call.cancel()
        await asyncio.wait_for(TinyScheduler.last.stream_ended.wait(), 10)
        # the handler's failure reaches plumbing.rpc's wrapper after its finally: on a loaded machine (the CI
        # run's two workers) that took longer than a fixed 0.1 s once, so wait for the record, up to 10 s
        deadline = asyncio.get_running_loop().time() + 10
        while not _cancelled_after_caller(caplog) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # and a moment more, for anything it would count or log after it
    after = sum(sample.value for metric in REQUEST_ERRORS.collect() for sample in metric.samples
                if sample.name.endswith("_total"))
    assert after == before
    assert not [record for record in caplog.records if record.levelno >= logging.INFO and "StreamDeltas" in record.getMessage()]
    assert _cancelled_after_caller(caplog)


def _cancelled_after_caller(caplog) -> list:
    return [record for record in caplog.records if "after its caller cancelled" in record.getMessage()]
