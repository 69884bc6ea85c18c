"""What Client and AsyncClient share: their settings, channel and stub, and the requests their calls send.
The two differ only in how a call waits (blocking or awaited), which each writes out itself."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from protos.tokenmill.v1 import generation_pb2, generation_pb2_grpc
from plumbing import tls as tls_config
from tokenmill.client.retry import Attempts, RetryPolicy
from tokenmill.client.types import chat_messages

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


class ClientBase:
    # tls_config.channel (blocking) or tls_config.aio_channel, set by each subclass
    open_channel: Callable

    def __init__(self, address: str = "127.0.0.1:50051", *, timeout: float | None = None,
                 retry: RetryPolicy | None = None, channel_options: Sequence[tuple] = (),
                 tls: bool | None = None, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None) -> None:
        self.address = address
        self.timeout = timeout  # default deadline per call, in seconds; None: none
        self.retry = retry or RetryPolicy()
        self._channel = type(self).open_channel(address, client_tls(tls, tls_ca, tls_cert, tls_key),
                                                [*CHANNEL_OPTIONS, *channel_options])
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    def _attempts(self, timeout: float | None) -> Attempts:
        """A call's attempts under the client's policy, all within timeout (None: the client's)."""
        return Attempts(self.retry, self.timeout if timeout is None else timeout)


def tokenize_request(text: str | None, messages: Sequence[dict] | None,
                     add_special_tokens: bool) -> generation_pb2.TokenizeRequest:
    request = generation_pb2.TokenizeRequest(add_special_tokens=add_special_tokens)
    if messages is not None:
        request.messages.CopyFrom(chat_messages(messages))
    else:
        request.text = text or ""
    return request
