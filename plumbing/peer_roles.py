"""Who may call an internal server: the role named in the caller's client certificate.

The scheduler and the worker serve no public API: with mutual TLS on (--tls-client-ca) each accepts
only callers whose certificate names an allowed role (the scheduler: gateway; the worker: scheduler),
as a URI in its subjectAltName:

    spiffe://tokenmill/gateway        spiffe://tokenmill/scheduler

Health and reflection stay open to any caller the TLS handshake let in (probes, grpcurl). Any other
method from a certificate without an allowed role is PERMISSION_DENIED. The handler can read the
caller's roles (current_roles()) for finer rules: only a gateway may set SubmitRequest.owner.

Without mutual TLS callers cannot be told apart, which is safe only on loopback:
check_internal_exposure() stops a process that would listen elsewhere unless --insecure-internal.
"""
from __future__ import annotations

import contextlib
import contextvars
import ipaddress
import logging
from collections.abc import Iterable

import grpc

from core.errors import PermissionDenied
from plumbing.handlers import run_inside

logger = logging.getLogger(__name__)

ROLE_URI_PREFIX = "spiffe://tokenmill/"
ROLES = ("gateway", "scheduler")
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
# the caller's roles during a call; None where roles are not checked (no mutual TLS)
_current_roles: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("peer_roles", default=None)


def current_roles() -> frozenset[str] | None:
    """The calling peer's roles inside a handler; None when this server does not check roles."""
    return _current_roles.get()


def certificate_roles(context: grpc.aio.ServicerContext) -> frozenset[str]:
    uris = context.auth_context().get("x509_subject_alternative_name", ())
    return frozenset(uri.decode()[len(ROLE_URI_PREFIX):] for uri in uris
                     if uri.decode(errors="replace").startswith(ROLE_URI_PREFIX))


class ClosedMethodsInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call but health and reflection (OPEN_METHOD_PREFIXES): a subclass's guard(handler,
    method, metadata) returns the handler to run, the original or one that refuses."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        return self.guard(handler, method, handler_call_details.invocation_metadata)

    def guard(self, handler: grpc.RpcMethodHandler, method: str, metadata) -> grpc.RpcMethodHandler:
        raise NotImplementedError


class PeerRoleInterceptor(ClosedMethodsInterceptor):
    def __init__(self, allowed_roles: Iterable[str], server_name: str) -> None:
        self.allowed_roles = frozenset(allowed_roles)
        self.server_name = server_name  # "scheduler", for messages

    def guard(self, handler: grpc.RpcMethodHandler, method: str, metadata) -> grpc.RpcMethodHandler:
        return _guarded(handler, lambda context: self._admit(context, method))

    def _admit(self, context: grpc.aio.ServicerContext, method: str) -> frozenset[str]:
        roles = certificate_roles(context)
        if not roles & self.allowed_roles:
            named = ", ".join(sorted(roles)) or "none"
            raise PermissionDenied(
                f"{method} on the {self.server_name} needs a client certificate naming the role "
                f"{' or '.join(sorted(self.allowed_roles))} (subjectAltName URI {ROLE_URI_PREFIX}<role>); "
                f"this one names {named}")
        return roles


def _guarded(handler: grpc.RpcMethodHandler, admit) -> grpc.RpcMethodHandler:
    @contextlib.contextmanager
    def admitted(context: grpc.aio.ServicerContext):
        token = _current_roles.set(admit(context))  # admit raises PermissionDenied before the servicer runs
        try:
            yield
        finally:
            _current_roles.reset(token)

    return run_inside(handler, admitted)


def interceptors(server_tls, allowed_roles: Iterable[str], server_name: str) -> list[grpc.aio.ServerInterceptor]:
    """The role check where callers present certificates (server_tls with a client CA); none otherwise."""
    if server_tls is None or not server_tls.client_ca:
        return []
    return [PeerRoleInterceptor(allowed_roles, server_name)]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve anywhere


def check_internal_exposure(name: str, host: str, mutual_tls: bool, insecure_internal: bool) -> None:
    """Stops (SystemExit) an internal server that would listen beyond loopback with nobody checking its
    callers, unless the operator said --insecure-internal; that is logged loudly."""
    if mutual_tls or is_loopback(host):
        return
    if not insecure_internal:
        raise SystemExit(
            f"{name}: --host {host} is not a loopback address, and without mutual TLS anyone who can reach it "
            f"may submit work and set request owners; add --tls-cert, --tls-key and --tls-client-ca (callers "
            f"then need a certificate naming their role), or --insecure-internal to accept that")
    logger.warning("INSECURE: %s listens on %s without mutual TLS (--insecure-internal): anyone who can reach "
                   "this port can call it and set request owners. Put it on a private network or turn on "
                   "--tls-client-ca.", name, host)


def add_arguments(parser, default_roles: Iterable[str]) -> None:
    """--tls-allowed-roles, --insecure-internal and --no-reflection for an internal server."""
    parser.add_argument("--tls-allowed-roles", default=",".join(default_roles),
                        help=f"with --tls-client-ca: the roles (comma-separated, of {', '.join(ROLES)}) a client "
                             f"certificate must name, as the subjectAltName URI {ROLE_URI_PREFIX}<role>, to call "
                             "anything but health and reflection (docs/security.md)")
    parser.add_argument("--insecure-internal", action="store_true",
                        help="listen on a non-loopback --host without mutual TLS (no caller authentication); "
                             "logged as a warning at start")
    parser.add_argument("--no-reflection", action="store_true", help="do not serve gRPC server reflection")


def allowed_roles_from_args(parser, args) -> frozenset[str]:
    roles = frozenset(role.strip() for role in args.tls_allowed_roles.split(",") if role.strip())
    unknown = sorted(roles - set(ROLES))
    if unknown or not roles:
        parser.error(f"--tls-allowed-roles {args.tls_allowed_roles!r}: roles are {', '.join(ROLES)}")
    return roles
