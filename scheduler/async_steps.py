"""Async scheduling's side of the Scheduler (scheduler.scheduler): step N + 1 is planned while step N is in
flight, so a step sent is taken as done at once (assume_done: placeholders for the tokens it samples) and its
real tokens replace them when its result comes (update_assumed, in step order). A part of Scheduler, kept apart
as WorkerLoss is: the rule reads these methods, and they read its queues and helpers."""
from __future__ import annotations

from core.outputs import RequestOutput
from core.step import PLACEHOLDER_TOKEN_ID, StepPlan, StepResult
from scheduler.request import Request, RequestStatus


class AsyncSteps:
    """Scheduler's methods for the steps in flight (they read its requests, queues and speculation)."""

    def assume_done(self, plan: StepPlan) -> None:
        """Takes a plan that was just sent as done, so the next one can be planned before its result:
        every scheduled request's computed count advances, and each that samples this step gets a
        placeholder token that update_assumed() replaces with the real one."""
        requests, spec_token_ids = self.requests, plan.spec_token_ids
        for request_id, num_scheduled in plan.num_scheduled_tokens.items():
            request = requests[request_id]
            if spec_token_ids and request_id in spec_token_ids:
                request.verifying = True  # 1 .. k + 1 tokens: update_assumed() applies them as update() does
                continue
            request.num_computed_tokens += num_scheduled
            if request.num_computed_tokens == request.num_tokens:
                request.all_token_ids.append(PLACEHOLDER_TOKEN_ID)
                request.num_pending_tokens += 1

    def update_assumed(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """update() for a plan that went through assume_done(); results must come in step order.

        A request that stops here may already be in the next plan (in flight): it is finished and its
        pages freed now, and that step's token for it is dropped (it is no longer in self.requests).
        The worker drops its copy with the plan after that one, so its pages are written at most by
        that in-flight step, which runs before any later step can hand them to another request."""
        self._observe_step(plan, result)
        outputs = []
        requests, spec_token_ids, sampled = self.requests, plan.spec_token_ids, result.sampled_token_ids
        prompt_logprobs, logprobs_by_request = result.prompt_logprobs, result.logprobs
        for request_id, num_scheduled in plan.num_scheduled_tokens.items():
            request = requests.get(request_id)
            drafts = spec_token_ids.get(request_id) if spec_token_ids else None
            if drafts is not None:  # never preempted while verifying (_pick_victim): running, or aborted and gone
                if request is not None:
                    request.verifying = False
                    outputs.extend(self._apply_verified(request, num_scheduled, drafts, result))
                continue
            if request is None:
                continue  # it ended while the step ran
            if prompt_logprobs:
                self._gather_prompt_logprobs(request, result)
            token_id = sampled.get(request_id)
            if token_id is None or not request.num_pending_tokens:
                continue  # a mid-prompt chunk
            index = request.num_known_tokens
            request.all_token_ids[index] = token_id
            request.num_pending_tokens -= 1
            logprobs = logprobs_by_request.get(request_id) if logprobs_by_request else None
            status = self._stop_status(request, token_id, num_tokens=index + 1)
            if status is not None:
                if request.status == RequestStatus.RUNNING:
                    self.running.remove(request)
                else:  # preempted while the step ran
                    self.waiting.remove(request)
                self._finish(request, status)
            outputs.append(self._output(request, [token_id], [logprobs] if logprobs else []))
        return outputs

    def _sits_out(self, request: Request) -> bool:
        """Async scheduling with speculation (scheduler.speculation): its drafts are being verified, or it would
        propose once its token in flight is known; it is planned again with its real tokens."""
        if request.verifying:
            return True
        speculation = self.speculation
        return bool(request.num_pending_tokens) and speculation is not None and speculation.wants_drafts(request)
