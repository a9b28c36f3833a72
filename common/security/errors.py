"""The one error of authentication: :class:`AuthError`, whose ``reason`` is safe to send to the client."""

from __future__ import annotations


class AuthError(Exception):
    """A request's credentials were refused. ``reason`` is short, fixed text ("missing credentials", "invalid API
    key", "token expired", ...) that the fronts send as is (gRPC UNAUTHENTICATED details, the HTTP 401 message):
    it never contains the credential, a key or a token."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
