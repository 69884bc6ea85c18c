"""The scheduler's queue gauges are exact at scrape time: requests that arrive while a step is in
flight sit in the loop's inbox until the step returns, and a scrape then must count them waiting."""
from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from core.sampling import SamplingParams
from plumbing.telemetry.metrics import SchedulerStatsCollector
from scheduler.config import SchedulerConfig
from scheduler.process.loop import EngineLoop
from scheduler.request import Request
from scheduler.scheduler import Scheduler
from tests.helpers.fake_executor import FakeExecutor


class SlowWorker:
    """The fake model behind a step that takes as long as the test says (a long forward pass)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.model = FakeExecutor(num_blocks, block_size)
        self.step_started = asyncio.Event()
        self.release = asyncio.Event()

    async def execute(self, plan):
        self.step_started.set()
        await self.release.wait()
        return self.model.execute(plan)


def scrape_gauges(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("tokenmill:num_requests")}


async def test_requests_arriving_during_a_step_are_counted_waiting():
    config = SchedulerConfig(num_blocks=64, block_size=16, max_num_seqs=16, max_num_batched_tokens=256)
    worker = SlowWorker(config.num_blocks, config.block_size)
    loop = EngineLoop(Scheduler(config), worker)
    registry = CollectorRegistry()
    registry.register(SchedulerStatsCollector(loop.stats, {"block_size": config.block_size}))
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    loop.start()
    try:
        loop.submit(Request("running", [1, 2, 3], params))
        await asyncio.wait_for(worker.step_started.wait(), 10)  # its first step is on the worker now
        for i in range(7):
            loop.submit(Request(f"queued-{i}", [4, 5, 6], params))
        await asyncio.sleep(0.05)  # the loop is still awaiting the step: nothing has been scheduled
        for _ in range(3):
            gauges = scrape_gauges(registry)
            assert gauges["tokenmill:num_requests_waiting"] == 7
            assert gauges["tokenmill:num_requests_running"] == 1
        worker.release.set()
        for _ in range(200):  # once the step returns, the loop schedules them all
            if scrape_gauges(registry)["tokenmill:num_requests_waiting"] == 0:
                break
            await asyncio.sleep(0.01)
        assert scrape_gauges(registry)["tokenmill:num_requests_waiting"] == 0
    finally:
        await loop.stop()
