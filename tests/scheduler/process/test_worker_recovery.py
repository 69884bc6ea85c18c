"""Worker recovery decides, the loop acts: the decisions alone, then the loop carrying out each one
(requeue and recompute, fail with retry off, fail everything when the worker stays away)."""
from __future__ import annotations

import asyncio

from core.errors import WorkerUnavailable
from core.outputs import FinishReason
from scheduler.config import SchedulerConfig
from scheduler.process.loop import EngineLoop
from scheduler.scheduler import Scheduler
from scheduler.process.worker_recovery import RecoveryAction, WorkerRecovery
from tests.helpers.fake_executor import FakeExecutor
from tests.scheduler.conftest import make_request


async def back_at_once(timeout_s: float) -> None:
    return None


async def never_back(timeout_s: float) -> None:
    raise ConnectionError("connection refused")


def test_a_failed_step_requeues_until_too_many_fail_in_a_row():
    recovery = WorkerRecovery(back_at_once, max_consecutive_failures=2)
    assert recovery.after_loss("boom").action is RecoveryAction.REQUEUE
    assert recovery.after_loss("boom").action is RecoveryAction.REQUEUE
    third = recovery.after_loss("boom")
    assert third.action is RecoveryAction.FAIL_REQUEUED and isinstance(third.error, WorkerUnavailable)
    assert "3 failed steps in a row" in str(third.error)
    recovery.step_succeeded()
    assert recovery.after_loss("boom").action is RecoveryAction.REQUEUE
    # the watcher seeing the connection break is not a failed step: it never counts towards the limit
    assert all(recovery.after_loss("gone", step_failed=False).action is RecoveryAction.REQUEUE for _ in range(5))


def test_retry_off_fails_the_requeued_requests():
    decision = WorkerRecovery(back_at_once, retry=False).after_loss(ConnectionError("worker gone"))
    assert decision.action is RecoveryAction.FAIL_REQUEUED and "retry is off" in str(decision.error)


async def test_waiting_resumes_when_the_worker_is_back_and_gives_up_after_the_timeout():
    recovery = WorkerRecovery(back_at_once)
    recovery.notice_loss()
    recovery.after_loss("gone", step_failed=False)
    assert (await recovery.wait_for_worker()).action is RecoveryAction.RESUME
    assert recovery.num_recoveries == 1 and not recovery.lost

    away = WorkerRecovery(never_back, reconnect_timeout_s=0.15)
    away.after_loss("gone")
    assert (await away.wait_for_worker()).action is RecoveryAction.WAIT
    await asyncio.sleep(0.1)
    final = await away.wait_for_worker()
    assert final.action is RecoveryAction.FAIL_ALL and "not back after 0.15s" in str(final.error)


class FailsFrom:
    """The fake model behind an await; every step from fail_at on raises (a worker that died)."""

    def __init__(self, fail_at: int) -> None:
        self.fake, self.fail_at = FakeExecutor(64, 4), fail_at
        self.block_size, self.num_blocks = 4, 64

    async def execute(self, plan):
        await asyncio.sleep(0)
        if plan.step_id >= self.fail_at:
            raise ConnectionError("worker gone")
        return self.fake.execute(plan)


async def last_output(stream):
    output = await asyncio.wait_for(stream.queue.get(), 10)
    while not output.finished:
        output = await asyncio.wait_for(stream.queue.get(), 10)
    return output


async def run_until_failed(recovery: WorkerRecovery | None, async_scheduling: bool):
    loop = EngineLoop(Scheduler(SchedulerConfig(num_blocks=64, block_size=4)), FailsFrom(fail_at=2),
                      worker_recovery=recovery, async_scheduling=async_scheduling)
    loop.start()
    outputs = await asyncio.gather(*(last_output(loop.submit(make_request([i + 1] * 5, max_tokens=20)))
                                     for i in range(2)))
    await loop.stop()
    assert loop.scheduler.kv.pool.num_used == 0 and not loop.scheduler.requests and not loop.streams
    return outputs


async def test_the_loop_acts_on_each_failing_decision():
    for async_scheduling in (False, True):
        for recovery, says in ((None, "step failed: worker gone"),
                               (WorkerRecovery(back_at_once, retry=False), "retry is off"),
                               (WorkerRecovery(never_back, reconnect_timeout_s=0.2), "not back after 0.2s")):
            for output in await run_until_failed(recovery, async_scheduling):
                assert isinstance(output.error, WorkerUnavailable) and says in str(output.error)
                assert output.finish_reason is FinishReason.ERROR and output.num_output_tokens < 20
