"""The scheduler's admission: request checks on its internal API and the bounded waiting queue."""
from __future__ import annotations

import math

import pytest

from scheduler.admission import Admission, AdmissionConfig
from scheduler.config import SchedulerConfig
from scheduler.process.loop import EngineLoop
from core.sampling import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.helpers.fake_executor import FakeExecutor
from core.errors import InvalidArgument, ResourceExhausted


def loop_with(max_waiting_requests: int = 100, max_waiting_tokens: int = 0) -> EngineLoop:
    admission = Admission(AdmissionConfig(max_waiting_requests, max_waiting_tokens), vocab_size=100, max_model_len=64)
    return EngineLoop(Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64)), FakeExecutor(64, 4),
                      admission=admission)


def request(request_id: str, prompt_len: int = 4, **params) -> Request:
    return Request(request_id, [1] * prompt_len, SamplingParams(**{"max_tokens": 4, **params}))


def test_waiting_requests_bound_names_the_flag():
    loop = loop_with(max_waiting_requests=3)
    for i in range(3):
        loop.submit(request(f"r{i}"))
    with pytest.raises(ResourceExhausted, match=r"3 requests waiting, --max-waiting-requests=3") as refused:
        loop.submit(request("r3"))
    assert refused.value.retry_after_s > 0 and "r3" not in loop.streams
    loop.abort("r0")
    loop.apply_inbox()  # the loop's own step: the abort frees a place
    loop.submit(request("r3"))


def test_waiting_tokens_bound_admits_a_large_prompt_into_an_empty_queue_only():
    loop = loop_with(max_waiting_tokens=20)
    loop.submit(request("big", prompt_len=30))  # alone: never refused forever
    with pytest.raises(ResourceExhausted, match=r"30 tokens waiting \+ 4 in this prompt > --max-waiting-tokens=20"):
        loop.submit(request("small"))


@pytest.mark.parametrize(("bad", "field"), [
    (Request("a", [], SamplingParams()), "prompt_token_ids"),
    (Request("a", [1, 100], SamplingParams()), r"prompt_token_ids\[1\]=100: must be a token id in \[0, 99\]"),
    (Request("a", [1] * 64, SamplingParams()), "at most 63 tokens"),
    (request("a", stop_token_ids=(5, 1000)), r"stop_token_ids\[1\]=1000"),
    (request("a", max_tokens=0), "max_tokens=0"),
    (request("a", temperature=math.nan), "temperature=nan"),
    (request("a", top_p=0.0), r"top_p=0.0: must be a finite number in \(0, 1\]"),
    (request("a", top_k=-2), "top_k=-2"),
    (request("a", logprobs=50), r"logprobs=50: must be in \[0, 20\]"),
])
def test_internal_api_refuses_what_would_break_a_worker_step(bad, field):
    loop = loop_with()
    with pytest.raises(InvalidArgument, match=field):
        loop.submit(bad)
    assert not loop.streams
