"""The blocking client of tokenmill.v1.Generation.

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

from protos.tokenmill.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from plumbing import tls as tls_config
from tokenmill.client.retry import RetryPolicy, deadline_after, time_left, wait_before_retry
from tokenmill.client.types import (Delta, GenerationResult, ModelInfo, RequestStatus, chat_messages,
                                    delta_from_proto, generate_request, model_info_from_proto,
                                    request_status_from_proto)

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.max_send_message_length", 64 * 2**20),
    # gRPC's own reconnect backoff starts at 1 s; retries would otherwise find the channel still waiting
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)


def client_tls(tls: bool | None, tls_ca: str | None, tls_cert: str | None,
               tls_key: str | None) -> tls_config.ClientTLS | None:
    """The client's TLS settings: on when tls is True or any file is given (no tls_ca: the system's
    roots); tls_cert/tls_key (PEM paths) for a gateway that requires client certificates (mTLS)."""
    if tls is False or not (tls or tls_ca or tls_cert or tls_key):
        return None
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together")
    return tls_config.ClientTLS(tls_ca, tls_cert, tls_key, option_prefix="tls")


class Client:
    def __init__(self, address: str = "127.0.0.1:50051", *, timeout: float | None = None,
                 retry: RetryPolicy | None = None, channel_options: Sequence[tuple] = (),
                 tls: bool | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        self.address = address
        self.timeout = timeout  # default deadline per call, in seconds; None: none
        self.retry = retry or RetryPolicy()
        self._channel = tls_config.channel(address, client_tls(tls, tls_ca, tls_cert, tls_key),
                                           [*CHANNEL_OPTIONS, *channel_options])
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

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
        deadline = deadline_after(self._timeout(timeout))
        attempt = 0
        while True:
            attempt += 1
            call = self._stub.GenerateStream(request, timeout=time_left(deadline))
            received = False
            try:
                for message in call:
                    received = True
                    yield delta_from_proto(message)
                return
            except grpc.RpcError as error:
                time.sleep(wait_before_retry(self.retry, error, attempt, received, deadline))
            finally:
                call.cancel()  # no-op once finished; aborts the request if the caller stopped early

    # -- the rest: safe to retry -------------------------------------------------------------------------

    def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None,
                 add_special_tokens: bool = True, timeout: float | None = None) -> list[int]:
        """Token ids of text (as generate would tokenize a prompt), or of chat messages after the template."""
        request = generation_pb2.TokenizeRequest(add_special_tokens=add_special_tokens)
        if messages is not None:
            request.messages.CopyFrom(chat_messages(messages))
        else:
            request.text = text or ""
        return list(self._unary(self._stub.Tokenize, request, timeout).token_ids)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True,
                   timeout: float | None = None) -> str:
        request = generation_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens)
        return self._unary(self._stub.Detokenize, request, timeout).text

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return model_info_from_proto(self._unary(self._stub.GetModelInfo, common_pb2.GetModelInfoRequest(), timeout))

    def request_status(self, request_id: str, *, timeout: float | None = None) -> RequestStatus:
        request = generation_pb2.GetRequestStatusRequest(request_id=request_id)
        return request_status_from_proto(self._unary(self._stub.GetRequestStatus, request, timeout))

    def cancel(self, request_id: str, *, timeout: float | None = None) -> bool:
        """True if the request was live and is now cancelled."""
        request = generation_pb2.CancelRequestRequest(request_id=request_id)
        return self._unary(self._stub.CancelRequest, request, timeout).cancelled

    def _unary(self, method, request, timeout: float | None):
        deadline = deadline_after(self._timeout(timeout))
        attempt = 0
        while True:
            attempt += 1
            try:
                return method(request, timeout=time_left(deadline))
            except grpc.RpcError as error:
                time.sleep(wait_before_retry(self.retry, error, attempt, False, deadline))

    def _timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout
