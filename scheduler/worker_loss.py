"""What the scheduler does when its worker is lost, or comes back with other page counts: its requests
go back to the queue to be recomputed (DESIGN invariant 2), and no plan names a page the worker lacks.
A part of Scheduler (scheduler.scheduler), kept apart because it is recovery, not the step."""
from __future__ import annotations

import dataclasses

from core.errors import InvalidArgument
from scheduler.request import RequestStatus


class WorkerLoss:
    """Scheduler's recovery methods (they read and reset its queues, pages and step bookkeeping)."""

    def requeue_after_worker_loss(self) -> list[str]:
        """The worker restarted with an empty KV cache: every running request goes back to the
        head of the queue (in its running order) to be recomputed from prompt + tokens so far, and
        the prefix cache forgets every page's content. Returns the re-queued ids."""
        requeued = [request.request_id for request in self.running]
        for request in [*self.running, *self.waiting]:
            request.drop_pending_tokens()  # async scheduling: the steps in flight died with the worker
        for request in reversed(self.running):  # add_preempted puts each at the head
            self.kv.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            self.waiting.add_preempted(request)
        for request in self.waiting:  # swapped ones: the host tier died with the worker too
            if self.kv.is_swapped(request.request_id):
                self.kv.free(request)
                request.num_computed_tokens = 0
        self.running = []
        self._on_worker.clear()  # the new worker holds nothing to drop
        self._dropped_tail.clear()
        self._dropped_since_last_plan = []
        self.latency.forget_steps_in_flight()
        self.kv.forget_cached_content()
        return requeued

    def adopt_worker_pages(self, num_blocks: int, num_host_blocks: int) -> list[tuple[str, InvalidArgument]]:
        """A worker came back with other page counts (its KV cache sized again from the memory it found):
        the scheduler takes them, so no plan names a page the worker lacks. Running requests are
        re-queued for recompute first (after a worker loss there are none left), so no request keeps a
        page id of the old pools. Returns the requests that no longer fit even alone, with why: the
        caller ends them (they would wait forever)."""
        self.requeue_after_worker_loss()
        self.config = dataclasses.replace(self.config, num_blocks=num_blocks, num_host_blocks=num_host_blocks)
        self.kv.resize(num_blocks, num_host_blocks)
        too_large = []
        for request in list(self.waiting):
            try:
                self.check_fits(request)
            except InvalidArgument as error:  # check_fits' RequestTooLarge
                too_large.append((request.request_id, error))
        return too_large
