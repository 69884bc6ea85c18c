"""A per-cluster shared secret on the internal links (gateway -> scheduler -> worker) without TLS.

On one machine every local process can reach the scheduler's and the worker's loopback ports, and the
scheduler trusts SubmitRequest.owner. `tokenmill serve` therefore makes a random secret per cluster and
hands it to gateway, scheduler and worker in the environment ($TOKENMILL_INTERNAL_SECRET, never argv,
which `ps` shows to every user); a process started by hand may read it from a 0600 file
(--internal-secret-file). With a secret:

    server (scheduler, worker)   interceptors(secret, "scheduler"): every call but health and reflection
                                 must carry it in the metadata key below, else UNAUTHENTICATED naming
                                 what is missing (never the secret); compared with hmac.compare_digest
    client (gateway, scheduler)  aio_channel_with_secret(address, tls, options, secret): every call carries it

Without one, nothing changes (a process started by hand behaves as before). Across hosts use mutual TLS
and its roles (plumbing.peer_roles); the two checks stack where both are on.
"""
from __future__ import annotations

import argparse
import hmac
import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from core.errors import Unauthenticated
from plumbing import keepalive
from plumbing import tls as tls_config
from plumbing.handlers import run_inside
from plumbing.peer_roles import ClosedMethodsInterceptor

logger = logging.getLogger(__name__)

ENV_VAR = "TOKENMILL_INTERNAL_SECRET"
METADATA_KEY = "tokenmill-internal-secret"
FILE_FLAG = "--internal-secret-file"


def new_secret() -> str:
    """A fresh random secret (256 bits, URL-safe text: a valid metadata value)."""
    return secrets.token_urlsafe(32)


# -- flags ---------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser, use: str) -> None:
    """--internal-secret-file; use says what this process does with the secret, for --help."""
    parser.add_argument(FILE_FLAG, default="",
                        help=f"file whose first line is the cluster's internal secret (default: ${ENV_VAR}, which "
                             f"`tokenmill serve` sets; neither: no secret): {use} (docs/security.md)")


def secret_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     environ: Mapping[str, str] = os.environ) -> str | None:
    """The secret from --internal-secret-file, else from the environment; None when neither has one.
    parser.error names the file when it cannot be read or its first line is empty."""
    path = args.internal_secret_file
    if not path:
        secret, source = environ.get(ENV_VAR, ""), f"${ENV_VAR}"
        if not secret:
            return None
    else:
        try:
            with open(path, encoding="utf-8") as file:
                secret, source = file.readline().strip(), f"{FILE_FLAG} {path}"
        except (OSError, UnicodeDecodeError) as error:
            parser.error(f"{FILE_FLAG} {path}: cannot read it ({getattr(error, 'strerror', None) or error})")
        if not secret:
            parser.error(f"{FILE_FLAG} {path}: the first line is empty")
    if not (secret.isascii() and secret.isprintable()):
        parser.error(f"{source}: the internal secret must be printable ASCII (it travels as gRPC metadata)")
    return secret


# -- the server's check ----------------------------------------------------------------------------------

class InternalSecretInterceptor(ClosedMethodsInterceptor):
    """Refuses (UNAUTHENTICATED) every call without the secret, except health and reflection."""

    def __init__(self, secret: str, server_name: str) -> None:
        self._secret = secret.encode()
        self.server_name = server_name  # "scheduler", for messages

    def guard(self, handler: grpc.RpcMethodHandler, method: str, metadata) -> grpc.RpcMethodHandler:
        sent = _sent_secret(metadata)
        if sent is not None and hmac.compare_digest(sent.encode(), self._secret):
            return handler
        carried = "none" if sent is None else "a different one"
        return _refusing(handler, f"{method} on the {self.server_name} needs this cluster's internal secret in the "
                                  f"'{METADATA_KEY}' metadata (`tokenmill serve` gives its processes the secret in "
                                  f"${ENV_VAR}; by hand: {FILE_FLAG}); the call carried {carried}")


def _sent_secret(metadata) -> str | None:
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value if isinstance(value, str) else value.decode(errors="replace")
    return None


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind that raises Unauthenticated (rpc.ErrorStatusInterceptor maps it)."""
    def refuse(context: grpc.aio.ServicerContext):
        raise Unauthenticated(message)

    return run_inside(handler, refuse)


def interceptors(secret: str | None, server_name: str) -> list[grpc.aio.ServerInterceptor]:
    """The secret check for an internal server; none without a secret."""
    if not secret:
        return []
    logger.info("%s: every call but health and reflection must carry the cluster's internal secret", server_name)
    return [InternalSecretInterceptor(secret, server_name)]


# -- the client's side -----------------------------------------------------------------------------------

class _SecretMetadata:
    """Adds the secret to a call's metadata. grpc.aio files each interceptor under the first call kind
    it implements, so each kind has its own class (_SENDERS); all four run the same method."""

    def __init__(self, secret: str) -> None:
        self._metadatum = (METADATA_KEY, secret)

    async def _intercept(self, continuation, client_call_details, request_or_iterator):
        details = client_call_details._replace(
            metadata=grpc.aio.Metadata(*(client_call_details.metadata or ()), self._metadatum))
        return await continuation(details, request_or_iterator)


_SENDERS = tuple(
    type(f"_SecretSender_{method}", (_SecretMetadata, kind), {f"intercept_{method}": _SecretMetadata._intercept})
    for kind, method in ((grpc.aio.UnaryUnaryClientInterceptor, "unary_unary"),
                         (grpc.aio.UnaryStreamClientInterceptor, "unary_stream"),
                         (grpc.aio.StreamUnaryClientInterceptor, "stream_unary"),
                         (grpc.aio.StreamStreamClientInterceptor, "stream_stream")))


def _senders(secret: str) -> list[grpc.aio.ClientInterceptor]:
    return [kind(secret) for kind in _SENDERS]


def aio_channel_with_secret(address: str, tls: tls_config.ClientTLS | None, options: Sequence[tuple[str, Any]] = (),
                secret: str | None = None) -> grpc.aio.Channel:
    """plumbing.tls.aio_channel, every call carrying the secret where there is one."""
    if not secret:
        return tls_config.aio_channel(address, tls, options)
    options = keepalive.channel_options(options)
    senders = _senders(secret)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=senders)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options + tls.channel_options(),
                                   interceptors=senders)
