"""Method behaviors behind a check, for server interceptors that serve both the threaded and the asyncio server.

An interceptor puts a handler's behavior behind a check (:func:`guard_handler`): the check runs first and either
hands the behavior the context to run with or refuses the call with a status. The guarded behavior is of the
same kind as the one it wraps (async generator, coroutine, or plain function), so grpc.aio still runs async
handlers on its loop and plain ones on its thread pool. :class:`common.rpc.server.AsyncioServer` drives
interceptors written for the threaded server (``intercept_service(continuation, details)`` returning a
handler) through :class:`AsyncInterceptor`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import grpc

_KINDS = {  # the handler attribute holding the behavior -> the handler constructor of that kind
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


class Refusal(Exception):
    """Raised by a check: the call ends with ``code`` and ``details`` and its behavior never runs."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


Check = Callable[[object, object], object]  # (request, context) -> the context the behavior runs with


def guarded(behavior: Callable, check: Check, response_streaming: bool) -> Callable:
    """``behavior`` of the same kind, run with the context ``check(request, context)`` returns; a
    :class:`Refusal` from the check ends the call with its status instead. A plain behavior refuses by setting
    the status and returning no message (grpc.aio runs it on a thread, where an ``abort`` of a streaming call
    never ends it)."""
    async def checked(request, context):  # the context to run with, or the call aborted
        try:
            return check(request, context)
        except Refusal as refusal:
            await context.abort(refusal.code, refusal.details)

    if inspect.isasyncgenfunction(behavior):

        async def stream(request, context):
            async for message in behavior(request, await checked(request, context)):
                yield message

        return stream
    if inspect.iscoroutinefunction(behavior):

        async def coroutine(request, context):
            return await behavior(request, await checked(request, context))

        return coroutine

    def plain(request, context):
        try:
            inner = check(request, context)
        except Refusal as refusal:
            context.set_code(refusal.code)
            context.set_details(refusal.details)
            return iter(()) if response_streaming else None
        return behavior(request, inner)

    return plain


def guard_handler(handler: grpc.RpcMethodHandler, check: Check, *,
                  request_deserializer: Callable | None = None) -> grpc.RpcMethodHandler:
    """``handler`` with its one behavior (whichever of the four kinds it is) behind ``check`` (:func:`guarded`),
    and its request deserializer replaced by ``request_deserializer`` when given."""
    for kind, make in _KINDS.items():
        behavior = getattr(handler, kind)
        if behavior is not None:
            return make(guarded(behavior, check, handler.response_streaming),
                        request_deserializer=request_deserializer or handler.request_deserializer,
                        response_serializer=handler.response_serializer)  # fmt: skip
    raise ValueError(f"gRPC method handler without a behavior: {handler!r}")


class AsyncInterceptor(grpc.aio.ServerInterceptor):
    """A threaded server's interceptor on a grpc.aio server: the handler is looked up on the loop, then handed
    to ``interceptor.intercept_service`` as an already answered continuation. Fit for interceptors that decide
    without blocking and guard handlers with :func:`guard_handler`."""

    def __init__(self, interceptor: grpc.ServerInterceptor) -> None:
        self.interceptor = interceptor

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        return self.interceptor.intercept_service(lambda _details: handler, handler_call_details)
