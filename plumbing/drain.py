"""Graceful drain on SIGTERM: refuse new work, let in-flight calls finish, then stop.

    drain = DrainInterceptor(["/tokenmill.v1.Generation/Generate"])   # method prefixes it guards
    server = rpc.create_server(interceptors=[drain])
    ...
    await wait_for_stop_signal()
    drain.refuse_new()                          # before readiness flips: NOT_SERVING never admits work
    await health.enter_graceful_shutdown()      # readiness NOT_SERVING: load balancers stop routing here
    unfinished = await drain.drain(timeout_s)   # new guarded calls: UNAVAILABLE; waits for in-flight ones
    await server.stop(grace=1.0)

Only the guarded methods (those that start work: Generate, Submit, ModelInfer) are refused and
counted; health, status queries and aborts keep answering while the process drains, so a gateway can
still cancel a request on a draining scheduler.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import grpc

from core.errors import Unavailable
from plumbing.handlers import run_inside

logger = logging.getLogger(__name__)


class InFlight:
    """Counts work in flight (`with in_flight:` around each piece) and waits for none to be left."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = asyncio.Event()

    def __enter__(self) -> None:
        self.count += 1

    def __exit__(self, *exc_info) -> None:
        self.count -= 1
        self._changed.set()

    async def wait_idle(self, timeout_s: float, what: str = "calls") -> int:
        """Waits up to timeout_s for the count to reach 0; returns what was left when it gave up."""
        logger.info("draining: %d %s in flight, up to %.1fs", self.count, what, timeout_s)
        try:
            async with asyncio.timeout(timeout_s):
                while self.count:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            logger.warning("drain timeout %.1fs passed with %d %s in flight", timeout_s, self.count, what)
        return self.count


class DrainInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, guarded_method_prefixes: Iterable[str]) -> None:
        self.guarded = tuple(guarded_method_prefixes)
        self.draining = False
        self._in_flight = InFlight()

    @property
    def in_flight(self) -> int:
        return self._in_flight.count

    def refuse_new(self) -> None:
        """Refuses new guarded calls from now on. Called before readiness turns NOT_SERVING (and before
        any await in between): a client that saw NOT_SERVING must never have its next call admitted."""
        self.draining = True

    async def drain(self, timeout_s: float) -> int:
        """Refuses new guarded calls from now on and waits (up to timeout_s) for the in-flight ones;
        returns how many were still running when it gave up (0: all finished)."""
        self.refuse_new()
        return await self._in_flight.wait_idle(timeout_s)

    def refuses(self, method: str) -> bool:
        """True when a call of `method` would be refused now (for interceptors that run before ours)."""
        return self.draining and method.startswith(self.guarded)

    def _admit(self, method: str) -> InFlight:
        if self.draining:
            raise Unavailable(f"this server is shutting down (draining); {method} was not started, retry elsewhere")
        return self._in_flight

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self.guarded):
            return handler
        return self._wrap(handler, method)

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return run_inside(handler, lambda context: self._admit(method))
