"""A worker that comes back with fewer KV pages (its memory truly gone; issue 31 item 3): the scheduler
adopts the smaller pool, re-admits the requests by recompute, and never plans a page id the new worker
lacks. Every plan each fake worker gets is checked against the pages it has, and the outputs equal an
undisturbed run (the fake executor reads tokens back through the block tables)."""
from __future__ import annotations

import asyncio

from core.errors import InvalidArgument
from core.outputs import FinishReason
from core.step import StepPlan
from scheduler.config import SchedulerConfig
from scheduler.process.loop import EngineLoop
from scheduler.scheduler import Scheduler
from scheduler.process.worker_recovery import WorkerPages, WorkerRecovery
from tests.helpers.fake_executor import FakeExecutor
from tests.scheduler.conftest import make_engine, make_request

BLOCK_SIZE = 4
BEFORE, AFTER = 64, 24  # pages of the first worker, of the one that came back


def page_ids(plan: StepPlan) -> list[int]:
    """Every device page id the plan names: new requests' tables, running ones' new pages, copies."""
    ids = [page for new in plan.new_requests for page in new.block_ids]
    ids += [page for cached in plan.cached_requests for page in cached.new_block_ids]
    return ids + [device for device, _host in plan.swap_out + plan.swap_in]


def requests():
    # 8 requests of up to 8 pages each: together they reach the top of the 64-page pool, alone each fits 24
    return [make_request([i + 1] * 22, max_tokens=10, request_id=f"req-{i}") for i in range(8)]


def tokens_of(outputs) -> list[int]:
    return [token for output in outputs for token in output.new_token_ids]


def undisturbed() -> dict[str, list[int]]:
    return {rid: tokens_of(outs) for rid, outs in make_engine(BEFORE, BLOCK_SIZE).run_to_completion(requests()).items()}


def test_adopting_fewer_pages_requeues_the_holders_of_vanished_pages_and_plans_below_the_new_count():
    engine = make_engine(BEFORE, BLOCK_SIZE)
    got: dict[str, list[int]] = {}
    for request in requests():
        engine.add_request(request)
    for _ in range(4):  # prefills and a few decodes
        for output in engine.step():
            got.setdefault(output.request_id, []).extend(output.new_token_ids)
    held = [page for r in engine.scheduler.running for page in engine.scheduler.kv.live_block_ids(r.request_id)]
    assert max(held) >= AFTER, "the test needs requests holding pages the smaller worker lacks"

    engine.executor = FakeExecutor(AFTER, BLOCK_SIZE)  # the worker that came back smaller
    assert engine.scheduler.adopt_worker_pages(AFTER, 0) == []
    assert not engine.scheduler.running and engine.scheduler.kv.pool.num_blocks == AFTER
    assert engine.scheduler.stats().num_blocks == AFTER
    while engine.has_unfinished():
        for output in engine.step():
            got.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert all(max(page_ids(plan), default=0) < AFTER for plan in engine.executor.plans)
    assert got == undisturbed()


class DiesThenComesBackSmaller:
    """The fake model behind an await: step fail_at raises (the worker died), and every step until
    reconnect() raises too; reconnect() brings a worker with `after` pages. Each plan a worker gets is
    checked against the pages of that worker."""

    def __init__(self, fail_at: int, after: int) -> None:
        self.fake, self.fail_at, self.after = FakeExecutor(BEFORE, BLOCK_SIZE), fail_at, after
        self.block_size, self.num_blocks = BLOCK_SIZE, BEFORE
        self.alive, self.restarts = True, 0
        self.pages_out_of_range: list[tuple[int, list[int]]] = []  # (step id, ids >= the worker's count)
        self.max_page_before_loss = -1

    async def execute(self, plan: StepPlan):
        await asyncio.sleep(0)
        if plan.step_id == self.fail_at and not self.restarts:
            self.alive = False
        if not self.alive:
            raise ConnectionError("worker gone")
        beyond = [page for page in page_ids(plan) if page >= self.fake.num_blocks]
        if beyond:
            self.pages_out_of_range.append((plan.step_id, beyond))
        if not self.restarts:
            self.max_page_before_loss = max(self.max_page_before_loss, *page_ids(plan), -1)
        return self.fake.execute(plan)

    async def reconnect(self, timeout_s: float) -> WorkerPages:
        self.fake, self.alive = FakeExecutor(self.after, BLOCK_SIZE), True
        self.restarts += 1
        return WorkerPages(self.after, 0)


async def last_output(stream):
    outputs = [await asyncio.wait_for(stream.queue.get(), 10)]
    while not outputs[-1].finished:
        outputs.append(await asyncio.wait_for(stream.queue.get(), 10))
    return outputs


async def run_with_a_smaller_restart(async_scheduling: bool, after: int, batch) -> tuple[dict, DiesThenComesBackSmaller]:
    worker = DiesThenComesBackSmaller(fail_at=4, after=after)
    loop = EngineLoop(Scheduler(SchedulerConfig(num_blocks=BEFORE, block_size=BLOCK_SIZE)), worker,
                      worker_recovery=WorkerRecovery(worker.reconnect), async_scheduling=async_scheduling)
    loop.start()
    streams = [loop.submit(request) for request in batch]
    results = await asyncio.gather(*(last_output(stream) for stream in streams))
    await loop.stop()
    assert loop.scheduler.kv.pool.num_used == 0 and not loop.scheduler.requests and not loop.streams
    return {request.request_id: outputs for request, outputs in zip(batch, results)}, worker


async def test_the_loop_adopts_a_worker_that_came_back_smaller_and_every_request_finishes():
    expected = undisturbed()
    for async_scheduling in (False, True):
        results, worker = await run_with_a_smaller_restart(async_scheduling, AFTER, requests())
        assert worker.restarts == 1 and worker.max_page_before_loss >= AFTER
        assert worker.pages_out_of_range == [], "a plan named a page the worker did not have"
        assert {rid: tokens_of(outs) for rid, outs in results.items()} == expected
        assert all(outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].error is None
                   for outs in results.values())


async def test_only_a_request_too_large_for_the_smaller_cache_even_alone_fails():
    big = make_request([7] * 40, max_tokens=30, request_id="needs-18-pages")  # 70 tokens: 18 pages of 4
    results, worker = await run_with_a_smaller_restart(False, 12, [*requests()[:3], big])
    assert worker.pages_out_of_range == []
    error = results["needs-18-pages"][-1].error
    assert isinstance(error, InvalidArgument) and "the KV cache has 12 pages" in str(error)
    assert results["needs-18-pages"][-1].finish_reason is FinishReason.ERROR
    assert all(outs[-1].finish_reason is FinishReason.LENGTH for rid, outs in results.items() if rid != "needs-18-pages")
