"""Waiting queues: FCFS, or priority (lower value first, then arrival).

Each queue counts the requests in it that carry their own TTFT target (num_ttft_targeted): the latency
targets pick the next request by deadline only when one does, and reading the count instead of scanning the
queue spares each admission a walk over thousands waiting (--max-waiting-requests, 4,096 by default)."""
from __future__ import annotations

import bisect
import itertools
from collections import deque
from typing import Iterator, Protocol

from scheduler.request import Request


class WaitingQueue(Protocol):
    num_ttft_targeted: int  # requests in the queue with a target_ttft_ms of their own

    def add(self, request: Request) -> None: ...
    def add_preempted(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


def _targeted(request: Request) -> int:
    return request.target_ttft_ms is not None


class FcfsQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self.num_ttft_targeted = 0

    def add(self, request: Request) -> None:
        self._queue.append(request)
        self.num_ttft_targeted += _targeted(request)

    def add_preempted(self, request: Request) -> None:
        # back at the head: it was admitted before everything still waiting
        self._queue.appendleft(request)
        self.num_ttft_targeted += _targeted(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        request = self._queue.popleft()
        self.num_ttft_targeted -= _targeted(request)
        return request

    def remove(self, request: Request) -> None:
        self._queue.remove(request)
        self.num_ttft_targeted -= _targeted(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        self._keys: list[tuple[int, float, int]] = []
        self._requests: list[Request] = []
        self._sequence = itertools.count()
        self.num_ttft_targeted = 0

    def add(self, request: Request) -> None:
        key = (request.priority, request.arrival_time, next(self._sequence))
        index = bisect.bisect(self._keys, key)
        self._keys.insert(index, key)
        self._requests.insert(index, request)
        self.num_ttft_targeted += _targeted(request)

    # a preempted request keeps its (priority, arrival) rank, which puts it ahead of later arrivals
    add_preempted = add

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        self._keys.pop(0)
        request = self._requests.pop(0)
        self.num_ttft_targeted -= _targeted(request)
        return request

    def remove(self, request: Request) -> None:
        index = next(i for i, r in enumerate(self._requests) if r is request)
        del self._keys[index]
        del self._requests[index]
        self.num_ttft_targeted -= _targeted(request)

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


def make_waiting_queue(policy: str) -> WaitingQueue:
    return PriorityQueue() if policy == "priority" else FcfsQueue()
