"""The asyncio client of tokenmill.v1.Generation (grpc.aio); the same methods as Client, awaited.

    async with AsyncClient("127.0.0.1:50051", timeout=30) as client:
        result = await client.generate("Hello", max_tokens=16, temperature=0)       # GenerationResult
        async for delta in client.stream([{"role": "user", "content": "Hi"}]):    # chat messages
            print(delta.text, end="")

Every method takes timeout= (seconds for the whole call, retries included; default: the client's);
a passed deadline raises ClientError with code DEADLINE_EXCEEDED. Failures raise ClientError.
Retries follow tokenmill.client.retry. Closing a stream early cancels the request; Python closes an
async generator left by `break` only when it is collected, so wrap it in contextlib.aclosing.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import grpc

from protos.tokenmill.v1 import common_pb2, generation_pb2
from plumbing import tls as tls_config
from tokenmill.client.base import ClientBase, tokenize_request
from tokenmill.client.types import (Delta, GenerationResult, ModelInfo, RequestStatus, delta_from_proto,
                                    generate_request, model_info_from_proto, request_status_from_proto)


class AsyncClient(ClientBase):
    open_channel = staticmethod(tls_config.aio_channel)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    # -- generation ------------------------------------------------------------------------------------

    async def generate(self, prompt: str | Sequence[dict] | None = None, *, messages: Sequence[dict] | None = None,
                 model: str = "", request_id: str = "", priority: int = 0, timeout: float | None = None,
                 **params) -> GenerationResult:
        """The whole completion. params: max_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
        presence_penalty, frequency_penalty, seed, logprobs, stop, stop_token_ids, ignore_eos.
        Runs over GenerateStream, so "retry only while nothing was received" means before the first token."""
        result = GenerationResult()
        async for delta in self.stream(prompt, messages=messages, model=model, request_id=request_id,
                                 priority=priority, timeout=timeout, **params):
            result.add(delta)
        return result

    async def stream(self, prompt: str | Sequence[dict] | None = None, *, messages: Sequence[dict] | None = None,
               model: str = "", request_id: str = "", priority: int = 0, timeout: float | None = None,
               **params) -> AsyncIterator[Delta]:
        """Deltas as they are generated; the last has finish_reason, usage and timings."""
        request = generate_request(prompt, messages, model, request_id, priority, params)
        attempts = self._attempts(timeout)
        while True:
            call = self._stub.GenerateStream(request, timeout=attempts.start())
            received = False
            try:
                async for message in call:
                    received = True
                    yield delta_from_proto(message)
                return
            except grpc.aio.AioRpcError as error:
                await asyncio.sleep(attempts.wait_s(error, received))
            finally:
                call.cancel()  # no-op once finished; aborts the request if the caller stopped early

    # -- the rest: safe to retry -------------------------------------------------------------------------

    async def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None,
                 add_special_tokens: bool = True, timeout: float | None = None) -> list[int]:
        """Token ids of text (as generate would tokenize a prompt), or of chat messages after the template."""
        request = tokenize_request(text, messages, add_special_tokens)
        return list((await self._unary(self._stub.Tokenize, request, timeout)).token_ids)

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                   timeout: float | None = None) -> str:
        request = generation_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return (await self._unary(self._stub.Detokenize, request, timeout)).text

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        reply = await self._unary(self._stub.GetModelInfo, common_pb2.GetModelInfoRequest(), timeout)
        return model_info_from_proto(reply)

    async def request_status(self, request_id: str, *, timeout: float | None = None) -> RequestStatus:
        request = generation_pb2.GetRequestStatusRequest(request_id=request_id)
        return request_status_from_proto(await self._unary(self._stub.GetRequestStatus, request, timeout))

    async def cancel(self, request_id: str, *, timeout: float | None = None) -> bool:
        """True if the request was live and is now cancelled."""
        request = generation_pb2.CancelRequestRequest(request_id=request_id)
        return (await self._unary(self._stub.CancelRequest, request, timeout)).cancelled

    async def _unary(self, method, request, timeout: float | None):
        attempts = self._attempts(timeout)
        while True:
            try:
                return await method(request, timeout=attempts.start())
            except grpc.aio.AioRpcError as error:
                await asyncio.sleep(attempts.wait_s(error, received=False))
