"""Who may call the gateway, and how often: API keys, then the key's rate limit, on every public API.

    access = AccessControl(ApiKeyStore(load_api_keys(path)) or None, RateLimiter(rps, burst))
    server = rpc.create_server(interceptors=[AccessInterceptor(access)])    # tokenmill.v1 + KServe gRPC
    app = web.Application(middlewares=[..., access_middleware(access)])    # OpenAI HTTP under /v1/

Health checks (grpc.health, KServe ServerLive/ServerReady/ModelReady) and reflection stay open (load
balancers and grpcurl carry no key), as do HTTP /health and /ready. Without a keys file authentication is off and every client shares the "anonymous" key's
rate limit (none unless --rate-limit-rps is given).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import grpc
from aiohttp import web

from gateway.access.api_keys import ApiKey, ApiKeyStore, load_api_keys
from gateway.access.rate_limit import ANONYMOUS, RateLimiter
from core.errors import ServingError
from plumbing.handlers import with_behavior
from plumbing.rpc import abort_with_status

# gRPC methods (full names start with "/service/") that need no key: health checks (KServe's own
# liveness/readiness calls included, which load balancers use like grpc.health) and reflection.
OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.", "/inference.GRPCInferenceService/ServerLive",
                      "/inference.GRPCInferenceService/ServerReady", "/inference.GRPCInferenceService/ModelReady")
OPEN_HTTP_PATHS = ("/health", "/ready")
API_KEY = "tokenmill.api_key"  # where access_middleware leaves the admitted ApiKey on an aiohttp request
logger = logging.getLogger("tokenmill.gateway.access")


class AccessControl:
    def __init__(self, keys: ApiKeyStore | None, limiter: RateLimiter) -> None:
        self.keys = keys  # None: authentication off
        self.limiter = limiter

    def admit(self, authorization: str | None) -> ApiKey:
        """Unauthenticated for a missing or wrong key, ResourceExhausted past its rate; else the key."""
        key = self.keys.authenticate(authorization) if self.keys is not None else ANONYMOUS
        self.limiter.take(key)
        return key


class AccessInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, access: AccessControl, skip: Callable[[str], bool] = lambda method: False) -> None:
        self.access = access
        # methods refused anyway (a draining server): no key check, no rate-limit token spent
        self.skip = skip

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_GRPC_PREFIXES) or self.skip(method):
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        authorization = next((value for key, value in metadata if key == "authorization"), None)
        try:
            self.access.admit(authorization)
        except ServingError as refusal:
            return _refusing(handler, refusal, method)
        return handler


def _refusing(handler: grpc.RpcMethodHandler, refusal: ServingError, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape that ends the call with refusal's status before reading anything."""

    async def refuse_unary(request, context):
        await abort_with_status(context, refusal, method)

    async def refuse_stream(request, context):
        await abort_with_status(context, refusal, method)
        yield  # never reached: makes this an async generator, as a streaming handler must be

    streams = bool(handler.unary_stream or handler.stream_stream)
    return with_behavior(handler, refuse_stream if streams else refuse_unary)


def access_middleware(access: AccessControl, skip: Callable[[], bool] = lambda: False):
    """aiohttp middleware: raises the refusal, for the app's error middleware (outside it) to answer.
    skip(): requests are refused anyway (draining), so no key check and no rate-limit token."""

    @web.middleware
    async def check_access(request: web.Request, handler):
        if request.path not in OPEN_HTTP_PATHS and not skip():
            request[API_KEY] = access.admit(request.headers.get("Authorization"))
        return await handler(request)

    return check_access


def caller_key(access: AccessControl | None, context: grpc.aio.ServicerContext) -> ApiKey | None:
    """A gRPC call's key (the interceptor already admitted it); None when keys are off."""
    if access is None or access.keys is None:
        return None
    metadata = context.invocation_metadata() or ()
    return access.keys.authenticate(next((value for key, value in metadata if key == "authorization"), None))


def caller_name(access: AccessControl | None, context: grpc.aio.ServicerContext) -> str | None:
    """A gRPC call's key name (the interceptor already admitted it); None when keys are off."""
    key = caller_key(access, context)
    return None if key is None else key.name


class AccessFlags(Protocol):
    """The three flags (declared by gateway.options.GatewayOptions) an AccessControl is built from."""

    api_keys_file: str  # empty: authentication off
    rate_limit_rps: float
    rate_limit_burst: int


def build_access(flags: AccessFlags) -> AccessControl:
    """From the gateway's options; a bad keys file stops the gateway with the file, line and field."""
    keys = None
    if flags.api_keys_file:
        try:
            keys = ApiKeyStore(load_api_keys(flags.api_keys_file))
        except (OSError, ValueError) as error:
            raise SystemExit(f"gateway: --api-keys-file: {error}") from None
        logger.info("API keys required: %d keys from %s", len(keys.keys), flags.api_keys_file)
    else:
        logger.warning("no --api-keys-file: authentication is off, every client is let in")
    if flags.rate_limit_rps < 0 or flags.rate_limit_burst < 0:
        raise SystemExit("gateway: --rate-limit-rps and --rate-limit-burst must be >= 0")
    return AccessControl(keys, RateLimiter(flags.rate_limit_rps, flags.rate_limit_burst))
