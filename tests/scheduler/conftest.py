from __future__ import annotations

import itertools

import pytest

from scheduler.config import SchedulerConfig
from scheduler.engine import EngineCore
from core.sampling import SamplingParams
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.helpers.fake_executor import FakeExecutor

_ids = itertools.count()


def make_request(prompt, max_tokens=8, request_id=None, **kwargs) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs.pop("params", {}))
    return Request(request_id or f"r{next(_ids)}", list(prompt), params, **kwargs)


def make_engine(num_blocks=64, block_size=4, async_scheduling=False, **config) -> EngineCore:
    scheduler = Scheduler(SchedulerConfig(num_blocks=num_blocks, block_size=block_size, **config))
    executor = FakeExecutor(num_blocks, block_size, config.get("sliding_window"))
    return EngineCore(scheduler, executor, async_scheduling=async_scheduling)


@pytest.fixture
def engine_factory():
    return make_engine
