"""The engine behind real processes: gateway -> scheduler -> worker over gRPC, Redis request state."""
from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.text.tokenizer import load_tokenizer
from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from core.sampling import SamplingParams
from tokenmill.llm import ENGINE_WORKER, LLM, EngineConfig
from plumbing.rpc import GENERATION_SERVICE, SCHEDULER_SERVICE, WORKER_SERVICE

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
             "What is 2 + 2?", "Who wrote Hamlet?", "Say hello in Spanish.", "What is a prime number?",
             "Describe the sea in one sentence.", "List two fruits.", "What does a CPU do?",
             "Why is the sky blue?", "Give me a synonym for happy.", "What is Python?",
             "How many legs does a spider have?", "Translate 'cat' to French.", "What is gravity?"]


def chat(question: str, max_tokens: int = 24, **params) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        messages=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user", content=question)]),
        parameters=generation_pb2.GenerateParameters(max_tokens=max_tokens, temperature=0.0, **params))


async def stream_text(stub, request) -> tuple[str, list[int], generation_pb2.GenerateStreamResponse]:
    text, ids, last = "", [], None
    async for message in stub.GenerateStream(request):
        text += message.text
        ids += message.token_ids
        last = message
    return text, ids, last


async def test_concurrent_streams_match_the_in_process_engine(cluster):
    config, _ = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        results = await asyncio.gather(*(stream_text(stub, chat(q)) for q in QUESTIONS))
        prompts = [list((await stub.Tokenize(generation_pb2.TokenizeRequest(messages=chat(q).messages))).token_ids)
                   for q in QUESTIONS]
    llm = LLM(EngineConfig(worker=replace(ENGINE_WORKER, num_blocks=256)), progress=False)
    tokenizer = load_tokenizer(None)
    expected = llm.generate_token_ids(prompts, SamplingParams(max_tokens=24, temperature=0.0,
                                                              stop_token_ids=tokenizer.stop_token_ids))
    for (text, ids, last), want in zip(results, expected):
        assert ids == want
        assert text == tokenizer.decode(want[:-1] if want[-1] in tokenizer.stop_token_ids else want)
        assert last.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        assert last.usage.completion_tokens == len(want)
    assert "Paris" in results[0][0]


async def test_cancel_mid_stream_frees_pages_and_is_recorded(cluster):
    config, _ = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel, \
            grpc.aio.insecure_channel(config.scheduler_address) as scheduler_channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        scheduler = scheduler_pb2_grpc.SchedulerStub(scheduler_channel)
        request = chat("Tell me a very long story.", max_tokens=400, ignore_eos=True)
        request.request_id = "cancel-me"
        call = stub.GenerateStream(request)
        received = 0
        async for _ in call:
            received += 1
            if received == 3:
                load = await scheduler.GetLoad(scheduler_pb2.GetLoadRequest(include_running_request_ids=True))
                assert "cancel-me" in load.running_request_ids and load.num_kv_pages_used > 0
                call.cancel()
                break
        for _ in range(100):  # a few steps at most
            load = await scheduler.GetLoad(scheduler_pb2.GetLoadRequest(include_running_request_ids=True))
            if load.num_kv_pages_used == 0:
                break
            await asyncio.sleep(0.05)
        assert load.num_kv_pages_used == 0 and load.num_running_requests == 0
        status = await _wait_for_status(stub, "cancel-me", generation_pb2.REQUEST_STATUS_CANCELLED)
        assert status.finish_reason == common_pb2.FINISH_REASON_ABORT


async def _wait_for_status(stub, request_id, wanted):
    for _ in range(100):  # records are written in batches, asynchronously
        try:
            status = await stub.GetRequestStatus(generation_pb2.GetRequestStatusRequest(request_id=request_id))
            if status.status == wanted:
                return status
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.NOT_FOUND
        await asyncio.sleep(0.05)
    raise AssertionError(f"{request_id} never reached status {wanted}")


async def test_finished_request_record_lives_in_redis(cluster):
    config, _ = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = chat("What is 2 + 2?", max_tokens=5, ignore_eos=True)
        request.request_id = "record-me"
        reply = await stub.Generate(request)
        assert reply.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(reply.token_ids) == 5
        # TTFT splits into the worker's own step and what queueing and the hops added
        assert 0 < reply.timings.first_token_forward_ns < reply.timings.time_to_first_token_ns
        status = await _wait_for_status(stub, "record-me", generation_pb2.REQUEST_STATUS_FINISHED)
    assert status.num_output_tokens == 5 and status.num_prompt_tokens == reply.usage.prompt_tokens
    assert status.finish_time.ToNanoseconds() >= status.arrival_time.ToNanoseconds() > 0
    client = redis.Redis.from_url(config.effective_redis_url)
    record = client.hgetall("tokenmill:req:record-me")
    assert record[b"status"] == b"finished" and record[b"finish_reason"] == b"LENGTH"
    assert 0 < client.ttl("tokenmill:req:record-me") <= 3600


async def test_stop_string_ends_the_stream_and_aborts_in_the_scheduler(cluster):
    config, _ = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        full = await stub.Generate(chat("Count from 1 to 20.", max_tokens=40))
        assert len(full.text) > 20
        stop = full.text[len(full.text) // 2:][:3]  # greedy: the same text comes again, cut here
        cut = await stub.Generate(chat("Count from 1 to 20.", max_tokens=40, stop=[stop]))
    assert cut.text == full.text[:full.text.index(stop)]
    assert cut.finish_reason == common_pb2.FINISH_REASON_STOP and cut.matched_stop == stop
    assert len(cut.token_ids) < len(full.token_ids)


async def test_invalid_argument_names_field_value_and_limit(cluster):
    config, _ = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Generate(chat("hi", top_p=1.5))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "top_p" in caught.value.details() and "1.5" in caught.value.details()
        assert "(0" in caught.value.details() or "0.0" in caught.value.details()
        reply = await stub.Generate(chat("hi", max_tokens=2))  # still serving
        assert len(reply.token_ids) >= 1


async def test_every_server_reports_health_and_reflection(cluster):
    config, _ = cluster
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    for address, service in ((config.gateway_address, GENERATION_SERVICE),
                             (config.scheduler_address, SCHEDULER_SERVICE),
                             (config.worker_address, WORKER_SERVICE)):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            services = ProtoReflectionDescriptorDatabase(channel).get_services()
            assert service in services and "grpc.health.v1.Health" in services


async def test_model_info_describes_the_served_model(cluster):
    config, _ = cluster
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        info = await generation_pb2_grpc.GenerationStub(channel).GetModelInfo(common_pb2.GetModelInfoRequest())
    model = info.model_config
    assert (model.architecture, model.num_layers, model.hidden_size, model.vocab_size) == ("llama", 30, 576, 49152)
    assert model.eos_token_id == 2 and model.has_chat_template and model.dtype == "float32"
    assert info.block_size == 16 and info.num_blocks > 0 and info.kv_cache_policy == common_pb2.KV_CACHE_POLICY_PAGED


async def test_two_gateways_share_one_scheduler(cluster):
    import sys

    from tokenmill.cluster.child_process import ChildSpec
    from tokenmill.cluster.readiness import free_port
    from tokenmill.cluster.supervisor import Supervisor

    config, _ = cluster
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    second = ChildSpec("gateway-2", [sys.executable, "-m", "gateway.main", "--port", address.split(":")[1],
                                     "--scheduler", config.scheduler_address, "--http-port", "0"],
                       GENERATION_SERVICE, address)
    with Supervisor([second], echo=False):
        async with grpc.aio.insecure_channel(config.gateway_address) as one, \
                grpc.aio.insecure_channel(address) as two:
            stubs = [generation_pb2_grpc.GenerationStub(one), generation_pb2_grpc.GenerationStub(two)]
            # each question once through each gateway, all at once
            replies = await asyncio.gather(*(stubs[i % 2].Generate(chat(QUESTIONS[i // 2], max_tokens=8))
                                             for i in range(8)))
    # both gateways reached the same scheduler and model: the same question gives the same greedy text
    for i in range(0, 8, 2):
        assert replies[i].text == replies[i + 1].text and replies[i].text
    assert len({r.request_id for r in replies}) == 8
