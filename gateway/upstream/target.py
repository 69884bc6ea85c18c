"""What the generation code sends requests to, as two protocols: a `SchedulerTarget` (one scheduler,
`SchedulerClient`, or several behind a `ReplicaRouter`) routes each request to a `Route`, the one
scheduler that takes that call.

    route = target.route(prompt_token_ids)      # Unavailable when no scheduler can take it
    probe = route.breaker.before_call()        # that scheduler's own breaker
    outputs = route.submit(request, deadline_unix_s=..., resumable=..., owner=..., timeout_s=...)
    await target.abort([request_id])           # wherever the request runs

A single scheduler is its own route. Behind a router each replica has its breaker, so one dead replica
never refuses calls that would go to a live one.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from core.outputs import FinishReason, RequestOutput
from core.requests import GenerationRequest
from gateway.upstream.circuit_breaker import CircuitBreaker
from protos.tokenmill.v1 import common_pb2


class Route(Protocol):
    """One call's scheduler."""

    @property
    def address(self) -> str:  # named in UNAVAILABLE messages
        ...

    @property
    def breaker(self) -> CircuitBreaker:
        ...

    def submit(self, request: GenerationRequest, *, deadline_unix_s: float | None = None, resumable: bool = False,
               owner: str | None = None, timeout_s: float | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the scheduler streams them; leaving early cancels the call (and aborts
        the request there). deadline_unix_s: the scheduler ends the request itself when it passes.
        resumable: the scheduler keeps it running if this gateway goes away (gateway.generation.resume).
        owner: the API key name that sent it, recorded with the request."""
        ...


class SchedulerTarget(Protocol):
    """Where the gateway's requests go: SchedulerClient (one scheduler) or ReplicaRouter (several)."""

    @property
    def address(self) -> str:  # the scheduler(s), for logs and UNAVAILABLE messages
        ...

    def route(self, prompt_token_ids: Sequence[int]) -> Route:
        """The scheduler that takes this prompt's call; Unavailable when none can."""
        ...

    async def abort(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> list[str]:
        """Ends the requests with reason wherever they run; returns the ids that were still running."""
        ...

    async def wait_ready(self, timeout_s: float) -> common_pb2.GetModelInfoResponse:
        """Waits until a scheduler reports ready; returns the model it serves."""
        ...

    async def close(self) -> None:
        ...
