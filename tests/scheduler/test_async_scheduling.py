"""Async scheduling: step N+1 is planned before step N's tokens are applied, with the same outputs.

The fake executor samples from what it reads back through the block tables, so a wrong page, a
placeholder token reaching a page or a prefix hash, or a lost token changes the outputs.
"""
from __future__ import annotations

from core.outputs import FinishReason
import asyncio

from scheduler.config import SchedulerConfig
from scheduler.process.loop import EngineLoop
from core.step import PLACEHOLDER_TOKEN_ID
from scheduler.scheduler import Scheduler
from tests.helpers.fake_executor import FakeExecutor
from tests.scheduler.conftest import make_engine, make_request

PROMPTS = [[1, 2, 3], list(range(1, 23)), [7] * 9, list(range(40, 53)), [5, 6]]
MAX_TOKENS = [9, 4, 13, 1, 6]


def run(async_scheduling: bool, stop_token_ids=(), prompts=PROMPTS, **config):
    engine = make_engine(num_blocks=64, block_size=4, max_num_batched_tokens=10,
                         async_scheduling=async_scheduling, **config)
    requests = [make_request(p, max_tokens=m, request_id=f"r{i}", params={"stop_token_ids": stop_token_ids})
                for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS))]
    results = engine.run_to_completion(requests)
    tokens = {rid: [t for o in outs for t in o.new_token_ids] for rid, outs in results.items()}
    finishes = {rid: (outs[-1].finish_reason, outs[-1].num_output_tokens) for rid, outs in results.items()}
    assert engine.scheduler.kv.pool.num_free == 64 and not engine.scheduler.requests
    return tokens, finishes, engine


def test_same_outputs_as_sync_with_chunked_prefill_and_length_finishes():
    sync_tokens, sync_finishes, _ = run(False)
    tokens, finishes, engine = run(True)
    assert tokens == sync_tokens and finishes == sync_finishes
    assert all(reason is FinishReason.LENGTH for reason, _ in finishes.values())
    assert all(t >= 0 for ts in tokens.values() for t in ts)
    # the 22-token prompt needs three chunks of at most 10: chunked prefill happened
    assert sum(1 for plan in engine.executor.plans if "r1" in plan.num_scheduled_tokens) >= 3 + 3


def test_stop_token_at_step_n_discards_step_n_plus_1_and_frees_pages():
    sync_tokens, _, _ = run(False)
    stop = sync_tokens["r2"][4]  # r2 stops at its 5th token (the others may stop too)
    expected_tokens, expected_finishes, _ = run(False, stop_token_ids=(stop,))
    tokens, finishes, engine = run(True, stop_token_ids=(stop,))
    assert tokens == expected_tokens and finishes == expected_finishes
    assert finishes["r2"] == (FinishReason.STOP, 5)
    # r2 was already in the plan after the one that sampled its stop token: the executor computed
    # a sixth token for it, which no output carries, and the plan after that dropped it
    plans = engine.executor.plans
    stopping = max(i for i, p in enumerate(plans) if "r2" in p.num_scheduled_tokens)
    assert any("r2" in p.finished_request_ids for p in plans[stopping + 1:])
    decode_steps = sum(1 for p in plans if p.num_scheduled_tokens.get("r2") == 1)
    assert decode_steps == 5  # tokens 2..5, and the discarded one


def test_next_plan_is_sent_before_the_previous_result_is_applied():
    engine = make_engine(async_scheduling=True)
    engine.add_request(make_request([1, 2, 3], max_tokens=4, request_id="solo"))
    engine.step()  # plans and sends step 0 (the prompt); its token is not applied yet
    request = engine.scheduler.requests["solo"]
    assert request.all_token_ids[-1] == PLACEHOLDER_TOKEN_ID and request.num_output_tokens == 1
    outputs = engine.step()  # sends step 1 (decoding the placeholder), then applies step 0
    assert [o.new_token_ids for o in outputs] == [[engine.executor.tokens["solo"][3]]]
    assert [p.num_scheduled_tokens for p in engine.executor.plans] == [{"solo": 3}, {"solo": 1}]
    assert request.num_pending_tokens == 1 and outputs[0].num_output_tokens == 1


def test_last_token_is_not_planned_past():
    """A request whose in-flight step brings it to max_tokens is not scheduled again."""
    _, _, engine = run(True)
    for rid, max_tokens in zip(("r0", "r3"), (9, 1)):
        decode_steps = sum(1 for p in engine.executor.plans if p.num_scheduled_tokens.get(rid) == 1)
        assert decode_steps == max_tokens - 1


def test_preempted_and_aborted_while_in_flight_keep_pages_consistent():
    engine = make_engine(num_blocks=64, block_size=4, async_scheduling=True)
    for i in range(3):
        engine.add_request(make_request([i + 1] * 6, max_tokens=8, request_id=f"p{i}"))
    engine.step()
    engine.step()
    victim = engine.scheduler.running[-1]
    assert victim.num_pending_tokens == 1
    engine.scheduler._preempt(victim)  # its step is in flight: its token must still arrive
    engine.abort_request("p0")
    results = engine.run_to_completion([])
    assert engine.scheduler.kv.pool.num_free == 64
    assert victim.num_output_tokens == 8 and PLACEHOLDER_TOKEN_ID not in victim.all_token_ids
    assert results and "p0" not in engine.scheduler.requests


class RecordingExecutor:
    """The fake model behind an await, one step at a time as on the worker; records when each plan
    arrives and when its result is returned."""

    def __init__(self) -> None:
        self.fake = FakeExecutor(64, 4)
        self.block_size, self.num_blocks = 4, 64
        self.events: list[tuple[str, int]] = []
        self._one_at_a_time = asyncio.Lock()

    async def execute(self, plan):
        self.events.append(("received", plan.step_id))
        async with self._one_at_a_time:
            await asyncio.sleep(0.002)
            result = self.fake.execute(plan)
        self.events.append(("end", plan.step_id))
        return result


async def loop_tokens(async_scheduling: bool):
    executor = RecordingExecutor()
    loop = EngineLoop(Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=10)),
                      executor, async_scheduling=async_scheduling)
    tokens = await run_prompts(loop)
    assert loop.scheduler.kv.pool.num_used == 0
    return tokens, executor.events


async def run_prompts(loop: EngineLoop) -> list[list[int]]:
    """Starts loop, submits PROMPTS with MAX_TOKENS, returns each one's tokens once all finish, stops it."""
    loop.start()
    streams = [loop.submit(make_request(p, max_tokens=m, request_id=f"l{i}")) for i, (p, m)
               in enumerate(zip(PROMPTS, MAX_TOKENS))]
    tokens = []
    for stream in streams:
        outputs = [await asyncio.wait_for(stream.queue.get(), 10)]
        while not outputs[-1].finished:
            outputs.append(await asyncio.wait_for(stream.queue.get(), 10))
        tokens.append([t for o in outputs for t in o.new_token_ids])
    await loop.stop()
    return tokens


async def test_engine_loop_pipelines_steps_with_the_same_tokens():
    sync_tokens, sync_events = await loop_tokens(False)
    tokens, events = await loop_tokens(True)
    assert tokens == sync_tokens
    # sync: each step's result is back before the next plan leaves; async: step N+1's plan is on the
    # worker before step N's result is back (all but the steps after an idle pipeline)
    assert sync_events == [e for n in range(len(sync_events) // 2) for e in (("received", n), ("end", n))]
    num_steps = len(events) // 2
    overlapped = [n for n in range(1, num_steps) if events.index(("received", n)) < events.index(("end", n - 1))]
    assert num_steps >= 10 and len(overlapped) >= num_steps - 3


def test_flag_reaches_the_scheduler_command_line_and_is_on_by_default():
    from scheduler.main import parse_args
    from tokenmill.cli import build_parser
    from tokenmill.cluster.config import ClusterConfig, with_settings
    from tokenmill.cluster.specs import cluster_specs

    assert not build_parser().parse_args(["serve", "--no-async-scheduling"]).async_scheduling
    assert build_parser().parse_args(["serve"]).async_scheduling  # issue 33: the overlapped loop by default
    assert parse_args([]).async_scheduling and not parse_args(["--no-async-scheduling"]).async_scheduling
    for enabled in (False, True):
        config = with_settings(ClusterConfig(), redis_url="redis://127.0.0.1:1", device="cpu", async_scheduling=enabled)
        scheduler = next(spec for spec in cluster_specs(config) if spec.name == "scheduler")
        assert parse_args(list(scheduler.argv[3:])).async_scheduling is enabled  # past "python -m scheduler.main"


class LosesWorkerOnce(RecordingExecutor):
    """The worker dies when step fail_at arrives: that step and any it still held fail, and the next
    steps go to a new worker with an empty cache."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at: int | None = fail_at
        self.worker_generation = 0

    async def execute(self, plan):
        if plan.step_id == self.fail_at:
            self.fail_at, self.fake = None, FakeExecutor(64, 4)
            self.worker_generation += 1
            raise ConnectionError("worker gone")
        generation = self.worker_generation
        self.events.append(("received", plan.step_id))
        async with self._one_at_a_time:
            await asyncio.sleep(0.002)
            if generation != self.worker_generation:
                raise ConnectionError("worker gone")
            result = self.fake.execute(plan)
        self.events.append(("end", plan.step_id))
        return result


async def test_worker_lost_with_two_steps_in_flight_recomputes_to_the_same_tokens():
    from scheduler.process.worker_recovery import WorkerRecovery

    async def reconnect(timeout_s: float) -> None:
        return None

    expected, _ = await loop_tokens(False)
    executor = LosesWorkerOnce(fail_at=6)
    loop = EngineLoop(Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_num_batched_tokens=10)),
                      executor, worker_recovery=WorkerRecovery(reconnect), async_scheduling=True)
    tokens = await run_prompts(loop)
    assert tokens == expected
    assert loop.worker_recovery.num_recoveries == 1 and loop.scheduler.kv.pool.num_used == 0
