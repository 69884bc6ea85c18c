"""Resume on every API, through a live cluster (tiny random model): a scheduler killed with -9 under
streams on tokenmill.v1 gRPC, OpenAI HTTP (server-sent events) and KServe, each of which the gateway
carries on by itself from Redis once the restarted scheduler re-admitted its request; an SSE client
reconnecting with Last-Event-ID to another gateway; a reused X-Request-Id refused; an orphan aborted.

The scheduler runs with --orphan-timeout-s 6, so the orphan test is quick and the others show that a
followed request is never taken for an orphan. (2 s was too short on a loaded 2-core CI machine: 48 clients
re-attaching after a gateway's kill took longer than that, and one resumed gRPC stream was aborted as an orphan.)"""
from __future__ import annotations

import asyncio
import collections
import json
import struct
import sys

import aiohttp
import grpc
import pytest
import redis

from plumbing.rpc import GENERATION_SERVICE
from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc, sampling_pb2, scheduler_pb2, \
    scheduler_pb2_grpc
from tests.e2e.faults_cluster import (cluster_log_on_failure, generate_ok, kill9, request,  # noqa: F401 (a fixture)
                                      tiny_cluster, wait_until)
from tokenmill.cluster.child_process import ChildSpec
from tokenmill.cluster.readiness import free_port
from tokenmill.cluster.supervisor import Supervisor

pytestmark = pytest.mark.slow

NUM_STREAMS = 16  # per API
TOKENS = 300  # per stream: a few seconds for 48 streams, so the kill lands mid-generation
ORPHAN_TIMEOUT_S = 6
ORPHAN_MAX_TOKENS = 16000  # ~1 ms a step at the least: reaped (within 1.25 x the timeout) long before its end


@pytest.fixture(scope="module")
def cluster_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("resume-everywhere")


@pytest.fixture(scope="module")
def cluster(cluster_dir):
    with tiny_cluster(cluster_dir, model_overrides={"max_position_embeddings": 16384}, num_blocks=2048, http_port=0,
                      extra_argv={"scheduler": ["--orphan-timeout-s", str(ORPHAN_TIMEOUT_S)]}) as running:
        yield running


def redis_tokens(config, request_id: str) -> tuple[list[int], list[bytes]]:
    """The request's token ids in its Redis stream (a resent entry counted once) and its finish reasons."""
    token_ids, finishes = [], []
    with redis.Redis.from_url(config.effective_redis_url) as client:
        for _, fields in client.xrange(f"tokenmill:tokens:{request_id}"):
            index, ids = int(fields[b"i"]), [int(t) for t in fields[b"t"].split()]
            token_ids += ids[max(len(token_ids) - index, 0):]
            finishes += [fields[b"f"]] if b"f" in fields else []
    return token_ids, finishes


async def replayed_text(stub, request_id: str, prompt: str) -> str:
    """The whole text of a request as the gateway sends it, replayed from Redis (resume from index 0)."""
    message = request(prompt, TOKENS, request_id)
    message.resume_from_index = 0
    return "".join([m.text async for m in stub.GenerateStream(message, timeout=60)])


async def read_sse(response, on_event=None) -> tuple[str, list[str], str | None, bool]:
    """A completions stream's text, its event ids, its finish reason and whether it ended with [DONE].
    on_event(ids): called after each event; a truthy return stops reading."""
    text, ids, finish, done = "", [], None, False
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if line.startswith("id: "):
            ids.append(line[4:])
        elif line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            assert "error" not in event, event
            choice = event["choices"][0]
            text, finish = text + choice["text"], choice["finish_reason"] or finish
            if on_event is not None and on_event(ids):
                break
    return text, ids, finish, done


def completion(prompt: str, max_tokens: int = TOKENS) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}


async def grpc_stream(stub, index: int, progress: dict, victim: str) -> tuple[list[int], str, int]:
    ids, text, finish = [], "", 0
    async for message in stub.GenerateStream(request(f"stream {index}", TOKENS, f"kill-{victim}-grpc-{index}"),
                                             timeout=180):
        ids, text, finish = ids + list(message.token_ids), text + message.text, message.finish_reason or finish
        progress[("grpc", index)] = len(ids)
    return ids, text, finish


async def http_stream(session, url: str, index: int, progress: dict, victim: str):
    def seen(ids):
        progress[("http", index)] = int(ids[-1].rpartition(":")[2]) if ids else 0

    async with session.post(url, json=completion(f"stream {index}"), headers={"X-Request-Id": f"kill-{victim}-http-{index}"},
                            timeout=aiohttp.ClientTimeout(total=180)) as response:
        assert response.status == 200, await response.text()
        return await read_sse(response, seen)


def kserve_request(service_pb2, model: str, index: int):
    infer = service_pb2.ModelInferRequest(model_name=model, id=f"kserve-{index}")
    infer.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(
        f"stream {index}".encode())
    infer.inputs.add(name="stream", datatype="BOOL", shape=[1]).contents.bool_contents.append(True)
    for key, field, value in (("max_tokens", "int64_param", TOKENS), ("temperature", "double_param", 0.0),
                              ("ignore_eos", "bool_param", True)):
        setattr(infer.parameters[key], field, value)
    return infer


async def kserve_stream(stub, infer, index: int, progress: dict) -> tuple[str, object]:
    text, final = "", None
    async for response in stub.ModelStreamInfer(iter([infer]), timeout=180):
        assert not response.error_message, response.error_message
        reply = response.infer_response
        for raw in reply.raw_output_contents:  # a BYTES tensor: 4-byte length, then the bytes
            (length,) = struct.unpack("<I", raw[:4])
            text += raw[4:4 + length].decode()
        progress[("kserve", index)] = progress.get(("kserve", index), 0) + 1
        if reply.parameters["triton_final_response"].bool_param:
            final = reply
    return text, final


def stream_keys(config) -> set[str]:
    with redis.Redis.from_url(config.effective_redis_url) as client:
        return {key.decode().removeprefix("tokenmill:tokens:") for key in client.scan_iter("tokenmill:tokens:*")}


@pytest.mark.parametrize("victim", ["scheduler", "worker"])
async def test_a_scheduler_or_worker_killed_under_16_streams_per_api_every_stream_goes_on_to_its_full_output(
        cluster, victim):
    """The scheduler: re-admitted from Redis, each stream followed there by its gateway. The worker: the
    scheduler recomputes its running requests on the restarted worker; the streams never break."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc  # tritonclient's stubs, as tests/gateway do

    config, supervisor = cluster
    before, progress = stream_keys(config), {}
    url = f"http://{config.http_address}/v1/completions"
    async with grpc.aio.insecure_channel(config.gateway_address) as channel, aiohttp.ClientSession() as session:
        stub, kserve = generation_pb2_grpc.GenerationStub(channel), service_pb2_grpc.GRPCInferenceServiceStub(channel)
        model = (await stub.GetModelInfo(common_pb2.GetModelInfoRequest(), timeout=10)).model_config.name
        streams = [asyncio.ensure_future(call) for index in range(NUM_STREAMS) for call in (
            grpc_stream(stub, index, progress, victim), http_stream(session, url, index, progress, victim),
            kserve_stream(kserve, kserve_request(service_pb2, model, index), index, progress))]

        async def all_streaming():
            for stream in streams:  # one that failed before the kill fails the test now, with its error
                if stream.done() and stream.exception() is not None:
                    raise stream.exception()
            return len(progress) == 3 * NUM_STREAMS and min(progress.values()) >= 3

        await wait_until(all_streaming, 60, "every stream's first tokens", interval_s=0.01)
        kill9(supervisor, victim)
        at_kill = dict(progress)
        grpc_results, http_results, kserve_results = [], [], []
        for number, result in enumerate(await asyncio.gather(*streams)):
            (grpc_results, http_results, kserve_results)[number % 3].append(result)
        assert max(count for (api, _), count in at_kill.items() if api != "kserve") < TOKENS, "killed mid-stream"
        for index, (ids, text, finish) in enumerate(grpc_results):
            streamed, finishes = redis_tokens(config, f"kill-{victim}-grpc-{index}")
            assert ids == streamed and len(ids) == TOKENS, f"gRPC stream {index}: lost or repeated tokens"
            assert finish == common_pb2.FINISH_REASON_LENGTH and finishes == [b"LENGTH"]
        for index, (text, ids, finish, done) in enumerate(http_results):
            assert done and finish == "length" and ids[-1] == f"kill-{victim}-http-{index}:{TOKENS}", (index, ids[-3:])
            assert text == await replayed_text(stub, f"kill-{victim}-http-{index}", f"stream {index}"), f"HTTP {index}"
        kserve_ids = stream_keys(config) - before - {f"kill-{victim}-{api}-{i}" for api in ("grpc", "http")
                                                       for i in range(NUM_STREAMS)}
        assert len(kserve_ids) == NUM_STREAMS, "KServe streams run under fresh resumable ids"
        replayed = [await replayed_text(stub, request_id, "stream") for request_id in kserve_ids]
        assert collections.Counter(text for text, _ in kserve_results) == collections.Counter(replayed)
        assert all(final.parameters["completion_tokens"].int64_param == TOKENS for _, final in kserve_results)
    assert supervisor.pid(victim) is not None


def second_gateway(config) -> tuple[ChildSpec, int, int]:
    grpc_port, http_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    spec = ChildSpec("gateway-2", [sys.executable, "-m", "gateway.main", "--port", str(grpc_port),
                                   "--http-port", str(http_port), "--scheduler", config.scheduler_address,
                                   "--model", config.model],
                     GENERATION_SERVICE, f"127.0.0.1:{grpc_port}", env={"TOKENMILL_REDIS_URL": config.effective_redis_url})
    return spec, grpc_port, http_port


async def test_an_sse_client_reconnects_with_last_event_id_to_another_gateway_and_continues(cluster):
    config, supervisor = cluster
    second, _, http_port = second_gateway(config)
    body = completion("Reconnect me", 600)
    with Supervisor([second], echo=False, startup_timeout_s=120) as gateways:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{http_port}/v1/completions", json=body) as response:
                assert response.status == 200
                first_text, first_ids, _, done = await read_sse(response, lambda ids: len(ids) >= 5)
                kill9(gateways, "gateway-2")  # before this client's connection closes: the gateway dies, not it
            assert not done and len(first_ids) >= 5
            last_id = first_ids[-1]
            request_id, _, sent = last_id.rpartition(":")
            assert 0 < int(sent) < 600
            # at once, as an SSE client would (not after this supervisor's stop: the orphan timeout is 6 s here)
            async with session.post(f"http://{config.http_address}/v1/completions", json=body,
                                    headers={"Last-Event-ID": last_id}) as response:
                assert response.status == 200, await response.text()
                rest_text, rest_ids, finish, done = await read_sse(response)
    assert done and finish == "length" and rest_ids[-1] == f"{request_id}:600"
    assert int(rest_ids[0].rpartition(":")[2]) > int(sent), "the ids go on from the last one the client had"
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        whole = await replayed_text(generation_pb2_grpc.GenerationStub(channel), request_id, "Reconnect me")
    assert first_text + rest_text == whole, "no text lost or repeated across the reconnect"
    assert len(redis_tokens(config, request_id)[0]) == 600


async def test_a_reused_x_request_id_is_refused_and_http_ids_are_found_by_get_request_status(cluster):
    config, _ = cluster
    url = f"http://{config.http_address}/v1/completions"
    async with aiohttp.ClientSession() as session, grpc.aio.insecure_channel(config.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        async with session.post(url, json=completion("Mine", 600), headers={"X-Request-Id": "http-taken"}) as live:
            assert live.status == 200
            await live.content.readline()  # it runs
            async with session.post(url, json=completion("Another prompt", 8),
                                    headers={"X-Request-Id": "http-taken"}) as reused:
                error = (await reused.json())["error"]
                assert reused.status == 409 and "request_id 'http-taken' is already taken" in error["message"], error
            status = await stub.GetRequestStatus(generation_pb2.GetRequestStatusRequest(request_id="http-taken"))
            assert status.status in (generation_pb2.REQUEST_STATUS_RUNNING, generation_pb2.REQUEST_STATUS_QUEUED)
        async with session.post(url, json={**completion("Look me up", 4), "stream": False}) as response:
            reply = await response.json()
        status = await stub.GetRequestStatus(generation_pb2.GetRequestStatusRequest(request_id=reply["id"]))
        assert status.status == generation_pb2.REQUEST_STATUS_FINISHED and status.num_output_tokens == 4
    assert redis_tokens(config, "http-taken")[0], "the first request's tokens, not overwritten"


async def test_an_orphaned_resumable_request_is_aborted_after_the_timeout_and_a_followed_one_is_not(cluster):
    config, _ = cluster

    def submit(request_id: str, max_tokens: int) -> scheduler_pb2.SubmitRequest:  # as a gateway would, which then dies
        return scheduler_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=[65, 66, 67], resumable=True,
                                           sampling_params=sampling_pb2.SamplingParams(
                                               max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    async with grpc.aio.insecure_channel(config.scheduler_address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        # the orphan far longer than the timeout (and its check) could take to reap it at this stack's step rate
        for request_id, max_tokens in (("orphan", ORPHAN_MAX_TOKENS), ("followed", 3000)):
            call = scheduler.Submit(submit(request_id, max_tokens))
            await call.read()
            call.cancel()  # its gateway is gone: a resumable request runs on
    async with grpc.aio.insecure_channel(config.gateway_address) as channel:
        follow = request("ABC", 3000, "followed")
        follow.resume_from_index = 0
        followed = [m async for m in generation_pb2_grpc.GenerationStub(channel).GenerateStream(follow, timeout=120)]

    def record(request_id: str) -> dict:
        with redis.Redis.from_url(config.effective_redis_url) as client:
            return client.hgetall(f"tokenmill:req:{request_id}")

    assert followed[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH, "followed: never taken for an orphan"
    assert sum(len(m.token_ids) for m in followed) == 3000
    # the reaper checks every quarter of the timeout: the orphan may still be running when the followed one ends
    await wait_until(lambda: asyncio.sleep(0, record("orphan").get(b"status") in (b"cancelled", b"finished")),
                     4 * ORPHAN_TIMEOUT_S, "the orphan's end")
    orphan = record("orphan")
    assert orphan[b"status"] == b"cancelled" and int(orphan[b"num_output_tokens"]) < ORPHAN_MAX_TOKENS, orphan
    assert redis_tokens(config, "orphan")[1] == [b"ABORT"]
    assert await wait_until(lambda: generate_ok(config.gateway_address), 30, "still serving")


async def grpc_until_cut(stub, index: int, progress: dict) -> list[int]:
    """A gRPC stream's token ids until its gateway dies under it (UNAVAILABLE)."""
    ids = []
    try:
        async for message in stub.GenerateStream(request(f"gw {index}", TOKENS, f"gw-grpc-{index}"), timeout=180):
            ids += list(message.token_ids)
            progress[("grpc", index)] = len(ids)
    except grpc.aio.AioRpcError as error:
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    return ids


async def sse_until_cut(session, url: str, index: int, progress: dict) -> tuple[str, list[str]]:
    """An SSE stream's text and event ids until its gateway dies under it."""
    text, ids = "", []
    try:
        async with session.post(url, json=completion(f"gw {index}"), headers={"X-Request-Id": f"gw-sse-{index}"},
                                timeout=aiohttp.ClientTimeout(total=180)) as response:
            async for raw in response.content:
                line = raw.decode().rstrip("\n")
                if line.startswith("id: "):
                    ids.append(line[4:])
                    progress[("sse", index)] = int(line.rpartition(":")[2])
                elif line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
    except aiohttp.ClientError:
        pass  # the connection died with the gateway
    return text, ids


async def test_a_gateway_killed_under_16_streams_per_api_every_client_continues_on_another(cluster):
    """kill -9 of a gateway under 16 gRPC streams, 16 SSE streams and 16 whole-text HTTP requests: each
    client continues on the other gateway at once (gRPC resume_from_index, SSE Last-Event-ID, the same
    X-Request-Id and body re-POSTed) and ends with the request's full output, nothing lost or repeated.
    KServe has no way to name a request again (its ids are the client's correlation ids, reused freely),
    so a KServe stream cut by its gateway's death ends with the connection: docs/reliability.md."""
    config, _ = cluster
    spec, grpc_port, http_port = second_gateway(config)
    dying_url, url = f"http://127.0.0.1:{http_port}/v1/completions", f"http://{config.http_address}/v1/completions"
    progress: dict = {}
    with Supervisor([spec], echo=False, startup_timeout_s=120) as gateways:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as dying, \
                grpc.aio.insecure_channel(config.gateway_address) as channel, aiohttp.ClientSession() as session:
            dying_stub, stub = generation_pb2_grpc.GenerationStub(dying), generation_pb2_grpc.GenerationStub(channel)
            whole_body = lambda index: {**completion(f"gw {index}"), "stream": False}  # noqa: E731
            cut = [asyncio.ensure_future(call) for index in range(NUM_STREAMS) for call in (
                grpc_until_cut(dying_stub, index, progress), sse_until_cut(session, dying_url, index, progress),
                session.post(dying_url, json=whole_body(index), headers={"X-Request-Id": f"gw-http-{index}"},
                             timeout=aiohttp.ClientTimeout(total=180)))]
            await wait_until(lambda: asyncio.sleep(0, len(progress) == 2 * NUM_STREAMS and min(progress.values()) >= 3),
                             60, "every stream's first tokens", interval_s=0.01)
            kill9(gateways, "gateway-2")
            results = await asyncio.gather(*cut, return_exceptions=True)

            async def grpc_rest(index: int, ids: list[int]) -> list[int]:
                message = request(f"gw {index}", TOKENS, f"gw-grpc-{index}")
                message.resume_from_index = len(ids)
                return ids + [t async for m in stub.GenerateStream(message, timeout=180) for t in m.token_ids]

            async def sse_rest(text: str, ids: list[str], index: int) -> tuple[str, list[str], str | None, bool]:
                async with session.post(url, json=completion(f"gw {index}"), headers={"Last-Event-ID": ids[-1]},
                                        timeout=aiohttp.ClientTimeout(total=180)) as response:
                    assert response.status == 200, await response.text()
                    rest, rest_ids, finish, done = await read_sse(response)
                return text + rest, rest_ids, finish, done

            async def http_again(index: int) -> dict:
                async with session.post(url, json=whole_body(index), headers={"X-Request-Id": f"gw-http-{index}"},
                                        timeout=aiohttp.ClientTimeout(total=180)) as response:
                    assert response.status == 200, await response.text()
                    return await response.json()

            finished = await asyncio.gather(*(
                grpc_rest(index, results[3 * index]) for index in range(NUM_STREAMS)), *(
                sse_rest(*results[3 * index + 1], index) for index in range(NUM_STREAMS)), *(
                http_again(index) for index in range(NUM_STREAMS)))
            for index in range(NUM_STREAMS):
                ids = finished[index]
                assert ids == redis_tokens(config, f"gw-grpc-{index}")[0] and len(ids) == TOKENS, f"gRPC {index}"
                text, rest_ids, finish, done = finished[NUM_STREAMS + index]
                assert done and finish == "length" and rest_ids[-1] == f"gw-sse-{index}:{TOKENS}", f"SSE {index}"
                assert text == await replayed_text(stub, f"gw-sse-{index}", f"gw {index}"), f"SSE {index} text"
                reply = finished[2 * NUM_STREAMS + index]
                assert reply["usage"]["completion_tokens"] == TOKENS, f"HTTP {index}"
                assert reply["choices"][0]["text"] == await replayed_text(stub, f"gw-http-{index}", f"gw {index}")
    assert max(progress[("grpc", i)] for i in range(NUM_STREAMS)) < TOKENS, "killed mid-stream"
