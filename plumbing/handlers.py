"""Server interceptors' one chore: a gRPC method handler of the same kind with other behaviour.

    behavior = behavior_of(handler)                    # the servicer's coroutine or async generator
    return with_behavior(handler, wrapped)             # same kind, same (de)serializers
    return run_inside(handler, lambda context: admitted())   # its behaviour inside a context manager

grpc.aio keeps a handler's kind (unary/stream request x unary/stream response) in four fields, one set;
a wrapper must be built with the matching factory and stay a coroutine or an async generator as the
original was. Written once here for every interceptor (errors, drain, API keys, peer roles, the
internal secret).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import grpc

_KINDS = (("unary_unary", grpc.unary_unary_rpc_method_handler), ("unary_stream", grpc.unary_stream_rpc_method_handler),
          ("stream_unary", grpc.stream_unary_rpc_method_handler),
          ("stream_stream", grpc.stream_stream_rpc_method_handler))


def behavior_of(handler: grpc.RpcMethodHandler) -> Callable:
    return next(getattr(handler, name) for name, _ in _KINDS if getattr(handler, name))


def with_behavior(handler: grpc.RpcMethodHandler, behavior: Callable,
                  request_deserializer: Callable | None = None) -> grpc.RpcMethodHandler:
    """A handler of handler's kind running behavior (request_deserializer: handler's unless given)."""
    make = next(make for name, make in _KINDS if getattr(handler, name))
    return make(behavior, request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer)


def run_inside(handler: grpc.RpcMethodHandler,
               enter: Callable[[grpc.aio.ServicerContext], AbstractContextManager]) -> grpc.RpcMethodHandler:
    """handler's behaviour inside `with enter(context)`, for the whole call (a stream's too); enter may
    raise to refuse the call before the servicer runs."""
    behavior = behavior_of(handler)
    if inspect.isasyncgenfunction(behavior):
        async def inside(request: Any, context: grpc.aio.ServicerContext):
            with enter(context):
                async for response in behavior(request, context):
                    yield response
    else:
        async def inside(request: Any, context: grpc.aio.ServicerContext):
            with enter(context):
                return await behavior(request, context)
    return with_behavior(handler, inside)
