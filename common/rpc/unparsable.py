"""A server interceptor that answers a request message that does not parse with INVALID_ARGUMENT.

gRPC's own answer to a request its deserializer rejects (invalid UTF-8 in a ``string`` field, a corrupt or
truncated wire format) is INTERNAL "Exception deserializing request!", which blames the server and names nothing.
With :class:`RejectUnparsable` (``build_server(..., interceptors=[..., RejectUnparsable()])``) the client gets
INVALID_ARGUMENT with the parser's reason, e.g. "request does not parse: Error parsing message with type
'pdserve.v1.GenerateRequest': String field had bad UTF-8", and the method's behavior never runs.

Methods with one request message (unary-unary, unary-stream) only; request streams are left as they are.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from common.rpc.guard import Refusal, guard_handler


class _Unparsable:
    """What the lenient deserializer returns in place of a message that does not parse."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class RejectUnparsable(grpc.ServerInterceptor):
    """Serves the threaded server as it is, and the asyncio one through :class:`common.rpc.guard.AsyncInterceptor`."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        deserialize = handler.request_deserializer

        def lenient(data: bytes):
            try:
                return deserialize(data)
            except DecodeError as exc:
                return _Unparsable(str(exc))

        return guard_handler(handler, _parsed, request_deserializer=lenient)


def _parsed(request, context):
    if isinstance(request, _Unparsable):
        raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"request does not parse: {request.reason}")
    return context
