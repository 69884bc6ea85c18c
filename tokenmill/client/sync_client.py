# Generated from async_client.py by `python -m tokenmill.client.generate_sync`; edit that file, not this one.
"""The blocking client of tokenmill.v1.Generation; AsyncClient has the same methods, awaited.

    with Client("127.0.0.1:50051", timeout=30) as client:
        result = client.generate("Hello", max_tokens=16, temperature=0)       # GenerationResult
        for delta in client.stream([{"role": "user", "content": "Hi"}]):    # chat messages
            print(delta.text, end="")

Every method takes timeout= (seconds for the whole call, retries included; default: the client's);
a passed deadline raises ClientError with code DEADLINE_EXCEEDED. Failures raise ClientError.
Retries follow tokenmill.client.retry. Leaving a stream early (break) cancels the request.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import grpc

from protos.tokenmill.v1 import common_pb2, generation_pb2
from plumbing import tls as tls_config
from tokenmill.client.base import ClientBase, tokenize_request
from tokenmill.client.types import (Delta, GenerationResult, ModelInfo, RequestStatus, delta_from_proto,
                                    generate_request, model_info_from_proto, request_status_from_proto)


class Client(ClientBase):
    open_channel = staticmethod(tls_config.channel)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    # -- generation ------------------------------------------------------------------------------------

    def generate(self, prompt: str | Sequence[dict] | None = None, *, messages: Sequence[dict] | None = None,
                 model: str = "", request_id: str = "", priority: int = 0, timeout: float | None = None,
                 **params) -> GenerationResult:
        """The whole completion. params: max_tokens, temperature, top_k, top_p, min_p, repetition_penalty,
        presence_penalty, frequency_penalty, seed, logprobs, stop, stop_token_ids, ignore_eos.
        Runs over GenerateStream, so "retry only while nothing was received" means before the first token."""
        result = GenerationResult()
        for delta in self.stream(prompt, messages=messages, model=model, request_id=request_id,
                                 priority=priority, timeout=timeout, **params):
            result.add(delta)
        return result

    def stream(self, prompt: str | Sequence[dict] | None = None, *, messages: Sequence[dict] | None = None,
               model: str = "", request_id: str = "", priority: int = 0, timeout: float | None = None,
               **params) -> Iterator[Delta]:
        """Deltas as they are generated; the last has finish_reason, usage and timings."""
        request = generate_request(prompt, messages, model, request_id, priority, params)
        attempts = self._attempts(timeout)
        while True:
            call = self._stub.GenerateStream(request, timeout=attempts.start())
            received = False
            try:
                for message in call:
                    received = True
                    yield delta_from_proto(message)
                return
            except grpc.RpcError as error:
                time.sleep(attempts.wait_s(error, received))
            finally:
                call.cancel()  # no-op once finished; aborts the request if the caller stopped early

    # -- the rest: safe to retry -------------------------------------------------------------------------

    def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None,
                 add_special_tokens: bool = True, timeout: float | None = None) -> list[int]:
        """Token ids of text (as generate would tokenize a prompt), or of chat messages after the template."""
        request = tokenize_request(text, messages, add_special_tokens)
        return list(self._unary(self._stub.Tokenize, request, timeout).token_ids)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                   timeout: float | None = None) -> str:
        request = generation_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self._unary(self._stub.Detokenize, request, timeout).text

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        reply = self._unary(self._stub.GetModelInfo, common_pb2.GetModelInfoRequest(), timeout)
        return model_info_from_proto(reply)

    def request_status(self, request_id: str, *, timeout: float | None = None) -> RequestStatus:
        request = generation_pb2.GetRequestStatusRequest(request_id=request_id)
        return request_status_from_proto(self._unary(self._stub.GetRequestStatus, request, timeout))

    def cancel(self, request_id: str, *, timeout: float | None = None) -> bool:
        """True if the request was live and is now cancelled."""
        request = generation_pb2.CancelRequestRequest(request_id=request_id)
        return self._unary(self._stub.CancelRequest, request, timeout).cancelled

    def _unary(self, method, request, timeout: float | None):
        attempts = self._attempts(timeout)
        while True:
            try:
                return method(request, timeout=attempts.start())
            except grpc.RpcError as error:
                time.sleep(attempts.wait_s(error, received=False))
