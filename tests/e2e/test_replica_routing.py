"""Two model replicas (scheduler + worker each, a tiny model) behind one gateway, Redis between them:
distinct concurrent prompts spread over both replicas, and prompts sharing a long prefix go to the
replica whose KV cache holds it — learned only from what that replica published to Redis, because
the prefixes are seeded by submitting straight to each scheduler, past the gateway."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import time

import grpc
import pytest
import redis

from kvstore.replica_keys import load_key, prefixes_key
from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2, scheduler_pb2, scheduler_pb2_grpc
from core.prefix_keys import extend_block_hashes
from tests.helpers.tiny_models import make_tiny_hf_model
from tokenmill.cluster.child_process import ChildSpec
from tokenmill.cluster.config import ClusterConfig, resolve_ports, with_settings
from tokenmill.cluster.specs import cluster_specs
from plumbing.rpc import GENERATION_SERVICE
from tokenmill.cluster.supervisor import Supervisor

BLOCK_SIZE = 16


def _replica_specs(config: ClusterConfig, suffix: str) -> list[ChildSpec]:
    """The worker and scheduler of one replica, renamed so two replicas can share a supervisor."""
    specs = {spec.name: spec for spec in cluster_specs(config)}
    worker = specs["worker"]
    return [dataclasses.replace(worker, name=f"worker-{suffix}", argv=[*worker.argv, "--threads", "1"]),
            dataclasses.replace(specs["scheduler"], name=f"scheduler-{suffix}")]


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory):
    folder, _ = make_tiny_hf_model(tmp_path_factory.mktemp("replicas"), "llama")
    base = dict(model=str(folder), block_size=BLOCK_SIZE, num_blocks=128, max_num_batched_tokens=256)
    first = resolve_ports(with_settings(ClusterConfig(), gateway_port=0, scheduler_port=0, worker_port=0, redis_port=0,
                                        **base))
    second = resolve_ports(with_settings(ClusterConfig(), gateway_port=first.gateway_port, scheduler_port=0,
                                         worker_port=0, redis_url=first.effective_redis_url, **base))
    redis_spec = cluster_specs(first)[0]
    gateway = cluster_specs(first)[-1]
    argv = list(gateway.argv)
    at = argv.index("--scheduler")
    argv[at:at + 2] = ["--scheduler", first.scheduler_address, "--scheduler", second.scheduler_address]
    assert gateway.health_service == GENERATION_SERVICE
    replicas = [Supervisor(_replica_specs(config, name), echo=False, startup_timeout_s=300)
                for config, name in ((first, "a"), (second, "b"))]
    pool = concurrent.futures.ThreadPoolExecutor(2)
    # the two replicas start (load their models) and stop at the same time: half the wall time
    with Supervisor([redis_spec], echo=False), pool, contextlib.ExitStack() as stack:
        stack.callback(lambda: list(pool.map(Supervisor.stop, replicas)))
        for started in [pool.submit(replica.start) for replica in replicas]:
            started.result()
        with Supervisor([dataclasses.replace(gateway, argv=argv)], echo=False, startup_timeout_s=300) as supervisor:
            yield first, second, redis.Redis.from_url(first.effective_redis_url, decode_responses=True), supervisor




def _wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _counts(store, replicas) -> list[int]:
    """Per-replica request counters from reports made after this call (so they count every request
    already answered)."""
    since_ms = time.time() * 1000
    reports = {}

    def fresh() -> bool:
        reports.update({r: store.hgetall(load_key(r)) for r in replicas})
        return all(report and int(report["reported_at_ms"]) > since_ms for report in reports.values())

    _wait_for(fresh, "fresh load reports from both replicas")
    return [int(reports[r]["num_requests_total"]) for r in replicas]


def _generate(prompt: str, max_tokens: int) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt=prompt, parameters=generation_pb2.GenerateParameters(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def test_distinct_concurrent_prompts_spread_over_both_replicas(two_replicas):
    first, second, store, _ = two_replicas
    replicas = [first.scheduler_address, second.scheduler_address]
    before = _counts(store, replicas)
    # distinct first characters: no prompt shares a single block with another
    prompts = [f"{chr(65 + i)} distinct prompt number {i} " * 3 for i in range(8)]
    async with grpc.aio.insecure_channel(first.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        replies = await asyncio.gather(*(stub.Generate(_generate(p, 24)) for p in prompts))
    assert all(len(reply.token_ids) == 24 for reply in replies)
    served = [after - was for after, was in zip(_counts(store, replicas), before)]
    assert sum(served) == len(prompts)
    assert min(served) >= 2, f"8 concurrent distinct prompts landed {served} on the two replicas"


async def test_shared_prefix_goes_to_the_replica_holding_it(two_replicas):
    first, second, store, _ = two_replicas
    replicas = [first.scheduler_address, second.scheduler_address]
    prefixes = ["The first long shared system prompt, about rivers and their deltas, and more. " * 2,
                "A second long shared system prompt, on mountains, glaciers and valleys here. " * 2]
    async with grpc.aio.insecure_channel(first.gateway_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        seeded_keys = []
        for prefix, replica in zip(prefixes, replicas):
            ids = list((await stub.Tokenize(generation_pb2.TokenizeRequest(text=prefix, add_special_tokens=True))).token_ids)
            assert len(ids) >= 8 * BLOCK_SIZE
            # seed the prefix on one replica only, straight to its scheduler: the gateway can learn
            # where it lives from that replica's Redis report and nowhere else
            async with grpc.aio.insecure_channel(replica) as scheduler_channel:
                submit = scheduler_pb2_grpc.SchedulerStub(scheduler_channel).Submit(scheduler_pb2.SubmitRequest(
                    request_id=f"seed-{replica}", prompt_token_ids=ids,
                    sampling_params=sampling_pb2.SamplingParams(max_tokens=1)))
                assert [message async for message in submit][-1].finished
            keys: list[bytes] = []
            extend_block_hashes(keys, ids, BLOCK_SIZE)
            seeded_keys.append(keys[-1].hex())
        for replica, key in zip(replicas, seeded_keys):
            _wait_for(lambda: store.sismember(prefixes_key(replica), key), f"{replica} to publish its prefix")
        assert not store.sismember(prefixes_key(replicas[1]), seeded_keys[0])
        before = _counts(store, replicas)
        time.sleep(2.0)  # the gateway reads the reports every 0.5 s; nothing outside it shows when it has
        for round_ in range(3):
            for prefix in prefixes:
                reply = await stub.Generate(_generate(prefix + f" question {round_}?", 4))
                assert len(reply.token_ids) == 4
                # the replica held all but the last partial block: the prompt's cached tokens say so
                assert reply.usage.cached_prompt_tokens >= 8 * BLOCK_SIZE
    served = [after - was for after, was in zip(_counts(store, replicas), before)]
    assert served == [3, 3], f"each prefix's 3 requests should go to its holder; per replica: {served}"
