"""The client's id of an n > 1 request names all its samples (`<id>-i`) at the tokenmill.v1 servicer:
CancelRequest cancels every sample (streamed by this gateway, or derived from the id when another gateway
replica streams them), GetRequestStatus reads one state from the samples' records, an idle-cut stream
records why under every sample's id; and the prompt-token counter counts the prompt once. On the
scripted scheduler of generation/test_samples (tests/gateway/apis/test_parallel_samples_apis.py cancels on the real
cluster)."""
from __future__ import annotations

import asyncio
import contextlib

import pytest
from prometheus_client import CollectorRegistry

from core.outputs import FinishReason
from gateway.generation.sample_groups import group_record
from gateway.apis.generation import GenerationServicer
from gateway.apis.served_model import ServedModel
from gateway.generation.generations import Generations
from gateway.apis.stream_idle import StreamIdle
from gateway.text.tokenizer import load_tokenizer
from kvstore.records import RecordStatus, RequestRecord
from plumbing.telemetry import metrics
from protos.tokenmill.v1 import common_pb2, generation_pb2
from tests.gateway.generation.test_samples import (
    LIMITS,
    PROMPT,
    ScriptedScheduler,
    prepared,
    samples,
)

MODEL_INFO = common_pb2.GetModelInfoResponse(model_config=common_pb2.ModelConfig(name="m"))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


class Scheduler(ScriptedScheduler):
    """Records each abort; aborts (answers) only ids it was given to run."""

    def __init__(self, scripts) -> None:
        super().__init__(scripts)
        self.aborts: list[list[str]] = []

    async def abort(self, request_ids, reason=FinishReason.ABORT):
        self.aborts.append(list(request_ids))
        submitted = {request.request_id for request in self.submitted}
        return [request_id for request_id in request_ids if request_id in submitted]


class Records:
    """kvstore.RequestStateReader's reads, from a dict; the records an idle stream marked failed."""

    def __init__(self, records: list[RequestRecord] = ()) -> None:
        self.records = {record.request_id: record for record in records}
        self.marked_failed: list[str] = []

    async def get_record(self, request_id):
        return self.records.get(request_id)

    async def mark_orphans_failed(self, request_ids, error):
        self.marked_failed += request_ids


class Context:
    def __init__(self, reads: bool = True) -> None:
        self.reads = reads  # False: a client that stopped reading (every write waits for ever)
        self.written = []

    def time_remaining(self):
        return None

    def invocation_metadata(self):
        return ()

    async def write(self, message):
        if not self.reads:
            await asyncio.Event().wait()
        self.written.append(message)


def stream_request(request_id: str, n: int = 2) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(prompt="Hello", request_id=request_id,
                                          parameters=generation_pb2.GenerateParameters(max_tokens=8, n=n))


def servicer(tokenizer, scheduler, records=None) -> GenerationServicer:
    return GenerationServicer(ServedModel(Generations(tokenizer, scheduler, records), MODEL_INFO, LIMITS))


async def until(condition) -> None:
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0.01)


async def test_cancel_by_the_client_id_cancels_every_sample_here_and_on_another_replica(tokenizer):
    scheduler = Scheduler({0: None, 1: None})
    here, other_replica = servicer(tokenizer, scheduler), servicer(tokenizer, scheduler)
    stream = asyncio.create_task(here.GenerateStream(stream_request("parent"), Context()))
    try:
        await until(lambda: len(scheduler.submitted) == 2)
        reply = await here.CancelRequest(generation_pb2.CancelRequestRequest(request_id="parent"), Context())
        assert reply.cancelled and reply.status == generation_pb2.REQUEST_STATUS_CANCELLED
        assert scheduler.aborts == [["parent-0", "parent-1"]]  # the samples it streams, exactly
        # a gateway that did not stream them: the id itself first, then every id a sample can have
        scheduler.aborts.clear()
        reply = await other_replica.CancelRequest(generation_pb2.CancelRequestRequest(request_id="parent"), Context())
        assert reply.cancelled
        assert scheduler.aborts == [["parent"], [f"parent-{index}" for index in range(LIMITS.max_samples)]]
    finally:
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)


async def test_an_idle_cut_stream_records_why_under_every_sample_id(tokenizer):
    scheduler, records = Scheduler({0: None, 1: [(5, -1.0)]}), Records()
    api = servicer(tokenizer, scheduler, records)
    api.stream_idle_timeout_s = 0.05
    with pytest.raises(StreamIdle):
        await api.GenerateStream(stream_request("idle"), Context(reads=False))
    assert sorted(records.marked_failed) == ["idle-0", "idle-1"]
    assert sorted(scheduler.cut) == ["idle-0", "idle-1"]  # then their calls closed (aborted)


def record(request_id, status, output_tokens, **fields) -> RequestRecord:
    return RequestRecord(request_id, status, num_prompt_tokens=7, num_output_tokens=output_tokens, **fields)


async def test_status_of_the_client_id_is_one_state_from_the_samples_records(tokenizer):
    records = Records([record("job-0", RecordStatus.FINISHED, 8, created_at=10.0, finished_at=12.0,
                              finish_reason=FinishReason.LENGTH),
                       record("job-1", RecordStatus.RUNNING, 3, created_at=10.0)])
    api = servicer(tokenizer, Scheduler({}), records)
    status = await api.GetRequestStatus(generation_pb2.GetRequestStatusRequest(request_id="job"), Context())
    assert status.request_id == "job" and status.status == generation_pb2.REQUEST_STATUS_RUNNING
    assert (status.num_prompt_tokens, status.num_output_tokens) == (7, 11)  # the prompt once
    assert not status.HasField("finish_time")
    records.records["job-1"] = record("job-1", RecordStatus.CANCELLED, 5, created_at=9.5, finished_at=13.0,
                                      finish_reason=FinishReason.ABORT)
    reply = await api.CancelRequest(generation_pb2.CancelRequestRequest(request_id="job"), Context())
    assert not reply.cancelled and reply.status == generation_pb2.REQUEST_STATUS_CANCELLED  # ended already
    ended = group_record("job", [records.records["job-0"], records.records["job-1"]])
    assert (ended.created_at, ended.finished_at, ended.num_output_tokens) == (9.5, 13.0, 13)


async def test_the_prompt_token_counter_counts_an_n_sample_prompt_once(tokenizer):
    registry = CollectorRegistry()
    registry.register(metrics.PROMPT_TOKENS)
    try:
        def counted() -> float:
            return sum(sample.value for family in registry.collect() for sample in family.samples
                       if sample.name == "tokenmill:prompt_tokens_total")

        before = counted()
        scheduler = Scheduler({index: [(5, -1.0)] for index in range(3)})
        deltas = samples(prepared(tokenizer, n=3), scheduler, tokenizer)
        async with contextlib.aclosing(deltas):
            assert len({delta.index async for delta in deltas}) == 3
        assert counted() - before == len(PROMPT)
    finally:
        registry.unregister(metrics.PROMPT_TOKENS)
