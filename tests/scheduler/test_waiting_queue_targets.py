"""The waiting queues count the requests in them that carry their own TTFT target, so the latency targets
read a count, not the whole queue, before each admission (scheduler/queue_policy.py). The count must stay
the truth through every way a request enters and leaves, under both policies; and with no targeted request
waiting, picking the next one must not walk the queue (thousands may wait: --max-waiting-requests)."""
from __future__ import annotations

import random

import pytest

from scheduler.config import SchedulerConfig
from scheduler.latency_targets import LatencyTargets
from scheduler.queue_policy import make_waiting_queue
from tests.scheduler.conftest import make_request


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_count_of_targeted_requests_follows_every_add_pop_and_remove(policy):
    rng = random.Random(7)
    queue, inside = make_waiting_queue(policy), []
    for _ in range(2000):
        operation = rng.choice(["add", "add", "add_preempted", "pop", "remove"])
        if operation.startswith("add") or not inside:
            request = make_request([1, 2, 3], priority=rng.randint(0, 3),
                                   target_ttft_ms=rng.choice([None, None, 50.0, 500.0]))
            getattr(queue, "add_preempted" if operation == "add_preempted" else "add")(request)
            inside.append(request)
        elif operation == "pop":
            inside.remove(queue.pop())
        else:
            request = rng.choice(inside)
            queue.remove(request)
            inside.remove(request)
        assert queue.num_ttft_targeted == sum(r.target_ttft_ms is not None for r in inside)
        assert len(queue) == len(inside)


class _NoWalk:
    """A waiting queue that fails if walked: the head alone must be read when nobody carries a target."""

    def __init__(self, queue):
        self._queue = queue
        self.num_ttft_targeted = queue.num_ttft_targeted

    def __len__(self):
        return len(self._queue)

    def peek(self):
        return self._queue.peek()

    def __iter__(self):
        raise AssertionError("the waiting queue was walked to pick its next request")


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_next_request_is_the_head_without_walking_the_queue_when_none_carries_a_target(policy):
    queue = make_waiting_queue(policy)
    requests = [make_request([i + 1] * 4) for i in range(5000)]
    for request in requests:
        queue.add(request)
    latency = LatencyTargets(SchedulerConfig(num_blocks=64, block_size=4, queue_policy=policy))
    assert latency.next_waiting(_NoWalk(queue)) is requests[0]

    targeted = make_request([9] * 4, target_ttft_ms=10.0)  # one with a target: now the deadline decides
    queue.add(targeted)
    assert queue.num_ttft_targeted == 1 and latency.next_waiting(queue) is targeted
    queue.remove(targeted)
    assert latency.next_waiting(_NoWalk(queue)) is requests[0]
