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

import grpc

from common.rpc.guard import Refusal, guard_handler
from common.security.auth import PRINCIPAL_ATTR, Authenticator, credential_of
from common.security.errors import AuthError

log = logging.getLogger(__name__)

OPEN_SERVICE_PREFIXES = ("/grpc.health.v1.Health/",)  # method paths that need no credential


class AuthInterceptor(grpc.ServerInterceptor):
    """Serves the threaded server as it is, and the asyncio one through
    :class:`common.rpc.guard.AsyncInterceptor` (behaviors keep their kind: :func:`common.rpc.guard.guard_handler`)."""

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
            return guard_handler(handler, _refuse(reason))
        return guard_handler(handler, lambda _request, context: AuthenticatedContext(context, principal))


class AuthenticatedContext:
    """A servicer context that also names the caller (``auth_principal``); everything else is the wrapped one's."""

    def __init__(self, context: grpc.ServicerContext, principal: str) -> None:
        self._context = context
        setattr(self, PRINCIPAL_ATTR, principal)

    def __getattr__(self, name: str):
        return getattr(self._context, name)


def _refuse(reason: str):
    def check(_request, _context):
        raise Refusal(grpc.StatusCode.UNAUTHENTICATED, reason)

    return check
