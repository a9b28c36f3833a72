"""The gRPC server interceptor that enforces an :class:`~common.security.auth.Authenticator` (the router's public
server: ``build_server(..., interceptors=[AuthInterceptor(authenticator)])``).

Every method needs a credential (``authorization: Bearer <token>`` or ``x-api-key: <key>`` metadata) except
those of ``grpc.health.v1.Health`` (probes stay open, like ``/healthz``); server reflection needs one too. A
refused call ends with ``UNAUTHENTICATED`` and the reason as its details ("missing credentials", "invalid API
key", "token expired", ...). An accepted call's handler gets a context whose ``auth_principal`` attribute
names the caller (:func:`~common.security.auth.principal_of`); the context is otherwise the server's own
(every attribute and method is delegated).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from common.security.auth import PRINCIPAL_ATTR, Authenticator, credential_of
from common.security.errors import AuthError

log = logging.getLogger(__name__)

OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/",)  # method paths that need no credential
_KINDS = {  # the handler attribute holding the behavior -> the handler constructor of that kind
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


class AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_SERVICE_PREFIXES):
            return handler
        try:
            principal = self.authenticator.authenticate(credential_of(handler_call_details.invocation_metadata))
        except AuthError as exc:
            reason = exc.reason
            log.info("refused %s: %s", method, reason)
            return _replace_behavior(handler, lambda _behavior: _refuse(reason))
        return _replace_behavior(handler, lambda behavior: _with_principal(behavior, principal))


class AuthenticatedContext:
    """A servicer context that also names the caller (``auth_principal``); everything else is the wrapped one's."""

    def __init__(self, context: grpc.ServicerContext, principal: str) -> None:
        self._context = context
        setattr(self, PRINCIPAL_ATTR, principal)

    def __getattr__(self, name: str):
        return getattr(self._context, name)


def _with_principal(behavior: Callable, principal: str) -> Callable:
    def call(request_or_iterator, context):
        return behavior(request_or_iterator, AuthenticatedContext(context, principal))

    return call


def _refuse(reason: str) -> Callable:
    def call(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    return call


def _replace_behavior(handler: grpc.RpcMethodHandler, wrap: Callable[[Callable], Callable]) -> grpc.RpcMethodHandler:
    """``handler`` with its one behavior (whichever of the four kinds it is) replaced by ``wrap(behavior)``."""
    for kind, make in _KINDS.items():
        behavior = getattr(handler, kind)
        if behavior is not None:
            return make(wrap(behavior), request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)  # fmt: skip
    raise ValueError(f"gRPC method handler without a behavior: {handler!r}")
