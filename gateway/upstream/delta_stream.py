"""The gateway's side of the scheduler's StreamDeltas: one call per scheduler carries each step's new
tokens for every request this gateway bound to it (why: scheduler.process.delta_streams).

    reader = DeltaReader(stub)
    queue = asyncio.Queue()
    stream_id = reader.bind(request_id, queue)    # "" while no stream is open: Submit carries everything
    ... Submit(..., delta_stream_id=stream_id); pump the call's messages into queue as FromSubmit(output)
    async for output in in_order(queue, request_id):
        ...
    reader.unbind(request_id)

A request's messages come from two calls, its Submit (the first and the last) and the delta stream (the
rest), so in_order puts them back in order by num_output_tokens. When the delta stream breaks, deltas it
had in flight are gone: a request missing some fails with Unavailable rather than skip tokens.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from core.errors import ServingError, Unavailable
from core.outputs import RequestOutput, coalesce
from plumbing.telemetry.tracing import background
from protos import codec
from protos.tokenmill.v1 import scheduler_pb2

logger = logging.getLogger(__name__)
# After a delta stream ends, how long requests go on Submit alone before a new one is opened (a
# scheduler that is down refuses at once; this keeps that from being tried on every request).
REOPEN_AFTER_S = 1.0


class Lost:
    """Put in a bound request's queue when its delta stream ended: what it had in flight is gone."""


LOST = Lost()


@dataclass(slots=True)
class FromSubmit:
    """A message of the request's own Submit call."""

    output: RequestOutput


@dataclass(slots=True)
class SubmitEnded:
    """The Submit call ended: with error (a typed ServingError), or cleanly (None) after its last message."""

    error: ServingError | None = None


class DeltaReader:
    def __init__(self, stub, address: str) -> None:
        self._stub = stub
        self.address = address
        self.stream_id = ""
        self._call = None
        self._task: asyncio.Task | None = None
        self._listeners: dict[str, asyncio.Queue] = {}  # the open stream's bound requests
        self._reopen_at = 0.0
        self._unsupported = False  # the scheduler has no StreamDeltas (an older version)

    def bind(self, request_id: str, queue: asyncio.Queue) -> str:
        """Routes request_id's deltas into queue; returns the stream id for its SubmitRequest, or "" when
        no stream is open (its Submit call then carries every message) or the id is bound already (a
        second call with a live request's id, which the scheduler refuses: it must not take the first's)."""
        if not self._open() or request_id in self._listeners:
            return ""
        self._listeners[request_id] = queue
        return self.stream_id

    def unbind(self, request_id: str, queue: asyncio.Queue) -> None:
        if self._listeners.get(request_id) is queue:
            del self._listeners[request_id]

    def _open(self) -> bool:
        if self._task is not None and not self._task.done():
            return True
        if self._unsupported or time.monotonic() < self._reopen_at:
            return False
        self.stream_id = uuid.uuid4().hex
        self._listeners = {}
        # opened by whichever request comes first, but it lives as long as the gateway: not that request's
        # work (its trace would hold a minutes-long call); the requests' tokens are traced by their steps
        with background():
            self._call = self._stub.StreamDeltas(scheduler_pb2.StreamDeltasRequest(stream_id=self.stream_id,
                                                                                   columns=True))
            self._task = asyncio.get_running_loop().create_task(self._read(self._call, self._listeners),
                                                                name=f"delta-stream-{self.address}")
        return True

    async def _read(self, call, listeners: dict[str, asyncio.Queue]) -> None:
        try:
            async for message in call:
                for output in codec.step_deltas_from_proto(message):
                    queue = listeners.get(output.request_id)
                    if queue is not None:  # else its caller left: dropped
                        queue.put_nowait(output)
        except grpc.aio.AioRpcError as error:
            if error.code() is grpc.StatusCode.UNIMPLEMENTED:
                self._unsupported = True
                logger.info("scheduler at %s has no StreamDeltas: every request's tokens come on its Submit call",
                            self.address)
            elif error.code() is not grpc.StatusCode.CANCELLED:
                logger.warning("delta stream from scheduler at %s ended: %s", self.address, error.details())
        finally:
            self._reopen_at = time.monotonic() + REOPEN_AFTER_S
            for queue in listeners.values():
                queue.put_nowait(LOST)
            listeners.clear()

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)


async def in_order(queue: asyncio.Queue, request_id: str) -> AsyncIterator[RequestOutput]:
    """The request's outputs from both sources, each once, in order, up to the finished one.

    Every output covers the tokens [num_output_tokens - len(new_token_ids), num_output_tokens); the Submit
    call's first message says where the request starts. An output that starts past what was yielded waits
    for the one before it; an ending with nothing after it to wait for raises Unavailable.

    Outputs that piled up while the caller was busy (its client slow to take the last write) come out as
    one (core.outputs.coalesce): a stream behind its steps writes once with all it missed, not once a step."""
    next_start: int | None = None  # where the next output must start; None before Submit's first message
    held: dict[int, RequestOutput] = {}
    pending: collections.deque = collections.deque()  # what was queued when the caller came back for more
    lost = submit_ended = False
    while True:
        if not pending:
            pending.append(await queue.get())
            while not queue.empty():
                pending.append(queue.get_nowait())
        item = pending.popleft()
        if isinstance(item, (FromSubmit, RequestOutput)):
            output = item.output if isinstance(item, FromSubmit) else item
            start = output.num_output_tokens - len(output.new_token_ids)
            if next_start is None and isinstance(item, FromSubmit):
                next_start = start
            held[start] = output
            if pending and isinstance(pending[0], (FromSubmit, RequestOutput)):
                continue  # more outputs came meanwhile: one yield for all of them
        elif isinstance(item, SubmitEnded):
            if item.error is not None:
                raise item.error
            submit_ended = True
        else:
            lost = True
        if (output := _next_run(held, next_start)) is not None:
            yield output
            if output.finished:
                return
            next_start = output.num_output_tokens
        if held and lost and next_start is not None:
            # the Submit call's messages never go missing; the delta stream's in flight when it broke did
            raise Unavailable(f"request {request_id!r}: the delta stream broke with its tokens from index "
                              f"{next_start} in flight")
        if submit_ended and not held:  # a clean end always comes after its last message
            raise Unavailable(f"request {request_id!r}: its Submit call ended before its last message")


def _next_run(held: dict[int, RequestOutput], next_start: int | None) -> RequestOutput | None:
    """The held outputs that follow on from next_start, taken out of held as one (None: none follows on),
    up to a finished one."""
    run = None
    while next_start is not None and (output := held.pop(next_start, None)) is not None:
        run = output if run is None else coalesce(run, output)
        if output.finished:
            break
        next_start = output.num_output_tokens
    return run
