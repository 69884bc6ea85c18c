"""Gateways' delta streams in the scheduler process: one StreamDeltas call per gateway, carrying one
message per step with the new tokens of every request that gateway bound to it.

Why: with a Submit call per request, each step costs one HTTP/2 write per running request here and
one read per request in the gateway, each a task wake-up and a pass through gRPC's Python layer. On a
CPU host those run on the cores the worker's compute threads need; batching them per step is what
vLLM (EngineCoreOutputs) and SGLang (BatchTokenIDOut) do between their engine and front end.

A request's first and last messages stay on its Submit call (scheduler.process.service): the first waits
for the request's record, the last carries the ending. The gateway orders the two sources by
num_output_tokens (gateway.upstream.delta_stream).
"""
from __future__ import annotations

import asyncio

from core.errors import AlreadyExists
from core.outputs import RequestOutput, coalesce


class DeltaStream:
    """One gateway's StreamDeltas call: deliver() adds a step's outputs, flush() queues them as one batch."""

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self.closed = False
        self._queue: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
        self._step: list[RequestOutput] = []

    def add(self, output: RequestOutput) -> bool:
        """True for the first output since the last flush (the caller flushes each stream it added to once)."""
        self._step.append(output)
        return len(self._step) == 1

    def flush(self) -> None:
        if self._step:
            self._queue.put_nowait(self._step)
            self._step = []

    async def next_batch(self) -> list[RequestOutput]:
        """The next step's outputs; when the reader fell behind, every queued step's, one entry per
        request (its deltas are consecutive: nothing of it goes elsewhere between its first and last)."""
        batch = await self._queue.get()
        if self._queue.empty():
            return batch
        merged: dict[str, RequestOutput] = {}
        for step in [batch, *self._drain()]:
            for output in step:
                earlier = merged.get(output.request_id)
                merged[output.request_id] = output if earlier is None else coalesce(earlier, output)
        return list(merged.values())

    def _drain(self) -> list[list[RequestOutput]]:
        steps = []
        while not self._queue.empty():
            steps.append(self._queue.get_nowait())
        return steps


class DeltaStreams:
    """The open delta streams by id."""

    def __init__(self) -> None:
        self._open: dict[str, DeltaStream] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, stream_id: str) -> DeltaStream:
        if stream_id in self._open:
            raise AlreadyExists("stream_id", stream_id)
        stream = self._open[stream_id] = DeltaStream(stream_id)
        return stream

    def get(self, stream_id: str) -> DeltaStream | None:
        return self._open.get(stream_id) if stream_id else None

    def close(self, stream: DeltaStream) -> None:
        """Its requests get their deltas on their Submit calls from the next step on (what it held unsent
        is lost with the call: its gateway no longer reads it, and fails the requests missing tokens)."""
        stream.closed = True
        if self._open.get(stream.stream_id) is stream:
            del self._open[stream.stream_id]
