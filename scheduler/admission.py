"""What the scheduler lets in: requests a worker can run, into a waiting queue of bounded size.

The gateway validates everything a public client sends. These checks guard the internal API
(tokenmill.v1.Scheduler.Submit) as well, because one token id outside the vocabulary would fail the
worker's whole step, and with it every request in the batch. The queue bounds make overload answer at
once (RESOURCE_EXHAUSTED naming the limit) instead of letting waits grow without end.

    admission = Admission(AdmissionConfig(max_waiting_requests=256, max_waiting_tokens=65536),
                          vocab_size=49152, max_model_len=8192)
    admission.check_request(request)                           # InvalidArgument naming field, value, limit
    admission.check_room(request, num_waiting, lambda: num_waiting_tokens)  # ResourceExhausted naming the bound
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.errors import InvalidArgument, ResourceExhausted
from core.sampling import MAX_LOGPROBS, SamplingLimits, check_sampling_params
from scheduler.request import Request

# What a client told "queue full" should wait before trying again: about the time a few requests
# take to leave the queue; a hint, not a promise.
RETRY_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    max_waiting_requests: int = 4096  # requests queued and not yet running (preempted ones included)
    # tokens still to compute over all waiting requests; 0: no bound. A request arriving at an empty
    # queue is always let in, so no prompt is refused forever for being larger than the bound.
    max_waiting_tokens: int = 0


class Admission:
    def __init__(self, config: AdmissionConfig, vocab_size: int, max_model_len: int) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._sampling_limits = SamplingLimits(max_logprobs=min(MAX_LOGPROBS, vocab_size))

    def check_request(self, request: Request) -> None:
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidArgument("prompt_token_ids", prompt, "must hold at least one token")
        if len(prompt) >= self.max_model_len:
            raise InvalidArgument("prompt_token_ids", prompt, f"must hold at most {self.max_model_len - 1} tokens "
                                  f"(max_model_len={self.max_model_len} - 1), got {len(prompt)}")
        for field, ids in (("prompt_token_ids", prompt), ("sampling_params.stop_token_ids",
                                                           request.sampling_params.stop_token_ids)):
            bad = next((i for i, token_id in enumerate(ids) if not 0 <= token_id < self.vocab_size), None)
            if bad is not None:
                raise InvalidArgument(f"{field}[{bad}]", ids[bad],
                                      f"must be a token id in [0, {self.vocab_size - 1}] (vocab_size={self.vocab_size})")
        # what a worker can run at all: a NaN temperature or a zero top_p would turn the whole batch's
        # logits into NaN on the worker
        check_sampling_params(request.sampling_params, self._sampling_limits, prefix="sampling_params.")

    def check_room(self, request: Request, num_waiting: int, waiting_tokens: Callable[[], int]) -> None:
        """Raises ResourceExhausted when request would push the waiting queue past a bound.

        waiting_tokens is called only when there is a token bound: summing over a queue of thousands
        on every submit would cost the loop more than the bound saves."""
        limit = self.config.max_waiting_requests
        if num_waiting >= limit:
            raise ResourceExhausted(f"scheduler waiting queue is full: {num_waiting} requests waiting, "
                                    f"--max-waiting-requests={limit}; retry later", retry_after_s=RETRY_AFTER_S)
        token_limit = self.config.max_waiting_tokens
        if not token_limit or not num_waiting:
            return
        num_waiting_tokens = waiting_tokens()
        if num_waiting_tokens + request.num_tokens > token_limit:
            raise ResourceExhausted(
                f"scheduler waiting queue is full: {num_waiting_tokens} tokens waiting + {request.num_tokens} "
                f"in this prompt > --max-waiting-tokens={token_limit}; retry later", retry_after_s=RETRY_AFTER_S)
