"""How the supervisor tells that a child is ready, and whether its port is free before it starts."""
from __future__ import annotations

import errno
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from plumbing import tls as tls_config
from plumbing.ports import free_port  # noqa: F401 - the cluster's callers import it from here

# Short reconnect backoff: by default a channel that found nobody listening waits up to 120 s before
# trying again, which would hide a worker that starts listening after a minute of model loading.
_PROBE_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]
_WILDCARD_HOSTS = {"", "0.0.0.0", "::", "[::]"}


def split_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port); '[::1]:50051' -> ('::1', 50051)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def connect_address(address: str) -> str:
    """Where a local client reaches a server listening on address (a wildcard host means loopback)."""
    host, port = split_address(address)
    return f"127.0.0.1:{port}" if host in _WILDCARD_HOSTS else address


def port_in_use(address: str) -> bool:
    """True if something listens on address. Raises OSError if the host cannot be bound at all.

    SO_REUSEADDR so that a port in TIME_WAIT from a previous run counts as free, as it is for the
    servers (which bind with SO_REUSEADDR too). Not SO_REUSEPORT: gRPC servers set it, so two of them
    would silently share a port; this check is what catches that.
    """
    host, port = split_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return True
            raise
    return False


class GrpcHealthProbe:
    """Readiness through grpc.health.v1 Check(service): ready when it answers SERVING."""

    def __init__(self, address: str, service: str, timeout_s: float = 0.5,
                 tls: tls_config.ClientTLS | None = None) -> None:
        self.address = connect_address(address)
        self.service = service
        self.timeout_s = timeout_s
        # a server with TLS (and mTLS) configured is probed over TLS, with a client cert if it needs one
        self._channel = tls_config.channel(self.address, tls, _PROBE_CHANNEL_OPTIONS)
        self._stub = health_pb2_grpc.HealthStub(self._channel)

    def __call__(self) -> tuple[bool, str]:
        try:
            # wait_for_ready: a refused connection waits (up to the timeout) instead of failing at once
            response = self._stub.Check(health_pb2.HealthCheckRequest(service=self.service),
                                        timeout=self.timeout_s, wait_for_ready=True)
        except grpc.RpcError as error:
            code = error.code()
            if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                return False, "not answering yet"
            if code is grpc.StatusCode.NOT_FOUND:
                return False, f"health has no service {self.service!r}"
            return False, f"health check {code.name}: {error.details()}"
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        return response.status == health_pb2.HealthCheckResponse.SERVING, status

    def close(self) -> None:
        self._channel.close()


def _resp_command(*words: str) -> bytes:
    """One command as a RESP array of bulk strings (safe for any bytes in a password)."""
    encoded = [word.encode() for word in words]
    return f"*{len(encoded)}\r\n".encode() + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in encoded)


def redis_ping_probe(host: str, port: int, timeout_s: float = 0.5, *, user: str | None = None,
                     password: str | None = None) -> tuple[bool, str]:
    """Readiness of a redis-server: it answers PING with +PONG (raw RESP, no client library needed),
    after AUTH when it has a password."""
    auth = b""
    if password is not None:
        auth = _resp_command("AUTH", *([user] if user else []), password)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(auth + b"PING\r\n")
            reply = sock.recv(256)
            if auth and reply.startswith(b"+OK\r\n") and len(reply) == 5:
                reply = sock.recv(256)  # the PONG came in a second packet
    except OSError:
        return False, "not answering yet"
    if auth:
        if not reply.startswith(b"+OK\r\n"):
            first_line = reply.partition(b"\r\n")[0]
            return False, f"AUTH answered {first_line[:60]!r}"  # -WRONGPASS: never ready, a config mistake
        reply = reply[5:]
    if reply.startswith(b"+PONG"):
        return True, "PONG"
    return False, f"PING answered {reply[:40]!r}"  # e.g. -LOADING while it reads a dump
