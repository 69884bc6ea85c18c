"""TLS and mutual TLS on the gRPC links (client -> gateway -> scheduler -> worker) and the HTTP API.

Each process has one listening side and at most one outgoing link, configured separately because
they differ in practice: a public gateway serves TLS to clients without certificates while its link
to the scheduler trusts a private CA and presents a client certificate.

    listening side (every main)          --tls-cert PEM --tls-key PEM [--tls-client-ca PEM]
                                         (--tls-client-ca: clients must present a cert it signed: mTLS)
    outgoing link (gateway, scheduler)   --scheduler-tls-ca PEM [--scheduler-tls-cert PEM --scheduler-tls-key PEM]
                                         --worker-tls-ca ...      (the CA turns TLS on for that link)

    server_tls = tls.server_tls_from_args(parser, args)   # ServerTLS | None
    tls.listen(server, "127.0.0.1:50051", server_tls)      # add_secure_port or add_insecure_port
    channel = tls.aio_channel("127.0.0.1:50052", tls.client_tls_from_args(parser, args, "scheduler"))

Files are read when the credentials are built, so a missing or non-PEM file fails at start-up with
the flag and the path in the message, not as an opaque handshake failure later.
"""
from __future__ import annotations

import argparse
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from plumbing import keepalive


class TLSConfigError(ValueError):
    """A TLS option that cannot work; the message names the option and the file."""


def read_pem(path: str | Path, option: str) -> bytes:
    """The file's bytes; raises TLSConfigError naming option when it is missing or not PEM."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise TLSConfigError(f"{option} {path}: cannot read it ({error.strerror})") from None
    if b"-----BEGIN " not in data:
        raise TLSConfigError(f"{option} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """The listening side: this server's certificate chain and key, and optionally the CA whose
    client certificates it requires (set: mutual TLS; None: any client may connect over TLS)."""

    cert: str
    key: str
    client_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        client_ca = read_pem(self.client_ca, "--tls-client-ca") if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(read_pem(self.key, "--tls-key"), read_pem(self.cert, "--tls-cert"))],
            root_certificates=client_ca, require_client_auth=client_ca is not None)

    def ssl_context(self) -> ssl.SSLContext:
        """The same policy for the HTTP API (aiohttp)."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        read_pem(self.cert, "--tls-cert")  # the same errors as the gRPC side, not ssl's
        read_pem(self.key, "--tls-key")
        context.load_cert_chain(self.cert, self.key)
        if self.client_ca:
            read_pem(self.client_ca, "--tls-client-ca")
            context.load_verify_locations(self.client_ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def argv(self) -> list[str]:
        """The flags that give a main this configuration."""
        return ["--tls-cert", self.cert, "--tls-key", self.key,
                *(["--tls-client-ca", self.client_ca] if self.client_ca else [])]


@dataclass(frozen=True, slots=True)
class ClientTLS:
    """The connecting side: the CA that signed the server's certificate (None: the system's roots)
    and the certificate this client presents to servers that require one."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    option_prefix: str = "--tls"  # how the options were spelled, for error messages
    # the name the server's certificate must carry when it is not the host dialed: replicas found by
    # --scheduler-dns are dialed by pod IP, while one certificate names their Service
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        prefix = self.option_prefix
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca, f"{prefix}-ca") if self.ca else None,
            private_key=read_pem(self.key, f"{prefix}-key") if self.key else None,
            certificate_chain=read_pem(self.cert, f"{prefix}-cert") if self.cert else None)

    def argv(self, peer: str) -> list[str]:
        """The flags that give a main this configuration for its link to peer ("scheduler", "worker")."""
        flags = []
        for name, value in (("ca", self.ca), ("cert", self.cert), ("key", self.key), ("server-name", self.server_name)):
            if value:
                flags += [f"--{peer}-tls-{name}", value]
        return flags

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def listen(server: grpc.aio.Server, address: str, tls: ServerTLS | None) -> int:
    """Adds the listening port (TLS when configured); returns the bound port, 0 if it is taken."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.credentials())


def aio_channel(address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    options = keepalive.channel_options(options)  # every channel pings an idle peer (plumbing.keepalive)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options + tls.channel_options())


def channel(address: str, tls: ClientTLS | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    options = keepalive.channel_options(options)
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.credentials(), options=options + tls.channel_options())


# -- command-line flags ------------------------------------------------------------------------------

def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("TLS on the listening port (docs/security.md)")
    group.add_argument("--tls-cert", help="PEM certificate chain this server presents; with --tls-key turns TLS on")
    group.add_argument("--tls-key", help="PEM private key of --tls-cert")
    group.add_argument("--tls-client-ca", help="PEM CA: clients must present a certificate it signed (mutual TLS)")


def server_tls_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServerTLS | None:
    """ServerTLS from the flags (files checked now), None when TLS is off; parser.error on a mistake."""
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        parser.error("--tls-cert and --tls-key go together (--tls-client-ca needs both)")
    tls = ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca)
    try:
        tls.credentials()
    except TLSConfigError as error:
        parser.error(str(error))
    return tls


def add_client_arguments(parser: argparse.ArgumentParser, peer: str) -> None:
    """--{peer}-tls-ca/-cert/-key for the outgoing link to peer ("scheduler" or "worker")."""
    group = parser.add_argument_group(f"TLS on the link to the {peer} (docs/security.md)")
    group.add_argument(f"--{peer}-tls-ca", help=f"PEM CA that signed the {peer}'s certificate; turns TLS on for the link")
    group.add_argument(f"--{peer}-tls-cert", help=f"PEM client certificate presented to the {peer} (mutual TLS)")
    group.add_argument(f"--{peer}-tls-key", help=f"PEM private key of --{peer}-tls-cert")
    group.add_argument(f"--{peer}-tls-server-name",
                       help=f"name the {peer}'s certificate must carry when it is not the dialed host "
                            f"(e.g. a Service name when addresses are pod IPs)")


def client_tls_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, peer: str) -> ClientTLS | None:
    attribute = peer.replace("-", "_")
    ca, cert, key, server_name = (getattr(args, f"{attribute}_tls_{name}") for name in ("ca", "cert", "key", "server_name"))
    if not (ca or cert or key or server_name):
        return None
    if bool(cert) != bool(key):
        parser.error(f"--{peer}-tls-cert and --{peer}-tls-key go together")
    if not ca:
        first = f"--{peer}-tls-cert" if cert else f"--{peer}-tls-server-name"
        parser.error(f"{first} needs --{peer}-tls-ca (the CA that signed the {peer}'s certificate)")
    tls = ClientTLS(ca, cert, key, option_prefix=f"--{peer}-tls", server_name=server_name)
    try:
        tls.credentials()
    except TLSConfigError as error:
        parser.error(str(error))
    return tls


@dataclass(frozen=True, slots=True)
class ClusterTLS:
    """TLS for a whole local cluster (`tokenmill serve`, tests) signed by one CA.

    Every server presents cert/key (its SANs must name the host clients dial: 127.0.0.1, localhost).
    With client_cert/client_key, every server also requires a client certificate signed by ca (mutual
    TLS on every link, clients -> gateway included), and the gateway, the scheduler and the
    supervisor's readiness probes present that one.
    """

    ca: str
    cert: str
    key: str
    client_cert: str | None = None
    client_key: str | None = None

    @property
    def mutual(self) -> bool:
        return self.client_cert is not None

    def server(self) -> ServerTLS:
        return ServerTLS(self.cert, self.key, self.ca if self.mutual else None)

    def client(self) -> ClientTLS:
        return ClientTLS(self.ca, self.client_cert, self.client_key)
