"""The router's gRPC handler driven from HTTP: a stand-in for ``grpc.ServicerContext``.

The OpenAI API and the WebSocket stream call :meth:`RouterServicer.Generate` directly (same validation,
routing, retries, metrics, records and traces as gRPC), with an :class:`HttpCallContext` in place of gRPC's
context:

- ``abort(code, details)`` raises :class:`CallAborted` (the HTTP layer turns it into a status and an error);
- ``add_callback(fn)``: ``fn`` runs once when the call ends: the client went away (:meth:`cancel`, called by
  :class:`DisconnectWatcher` or a failed write) or the HTTP layer finished (:meth:`done`);
- ``time_remaining()``: from the ``X-Request-Timeout`` header (seconds), else None (the router's default);
- ``invocation_metadata()``: the HTTP headers a trace continues from (``traceparent``, ``tracestate``);
- the caller's principal, as the HTTP front authenticated it, under ``auth_principal`` like a gRPC context's
  (:func:`common.security.auth.principal_of` reads it; None when auth is off).
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Mapping

import grpc

from common.security.auth import PRINCIPAL_ATTR

TIMEOUT_HEADER = "X-Request-Timeout"


class CallAborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailing: tuple = ()) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing = code, details, dict(trailing)


class HttpCallContext:
    def __init__(self, headers: Mapping[str, str], principal: str | None = None) -> None:
        """``headers``: the HTTP request's (``X-Request-Timeout``: ValueError if not a positive number).
        ``principal``: who calls (``principal_of(request)`` of the HTTP request; None: auth off)."""
        setattr(self, PRINCIPAL_ATTR, principal)
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._ended = False
        self._trailing: tuple = ()
        self.cancelled = False
        self._metadata = tuple((k.lower(), v) for k, v in headers.items() if k.lower() in ("traceparent", "tracestate"))
        self._deadline_s: float | None = None
        raw = headers.get(TIMEOUT_HEADER)
        if raw is not None:
            try:
                timeout_s = float(raw)
            except ValueError:
                timeout_s = -1.0
            if not 0 < timeout_s < float("inf"):
                raise ValueError(f"{TIMEOUT_HEADER} must be a positive number of seconds, got {raw!r}")
            self._deadline_s = time.monotonic() + timeout_s

    # -- what RouterServicer.Generate uses ---------------------------------------------------------------

    def abort(self, code: grpc.StatusCode, details: str):
        raise CallAborted(code, details, self._trailing)

    def add_callback(self, fn: Callable[[], None]) -> bool:
        with self._lock:
            if not self._ended:
                self._callbacks.append(fn)
                return True
        fn()  # already over (the client left): a call added now must still be cancelled
        return True

    def time_remaining(self) -> float | None:
        return None if self._deadline_s is None else max(0.0, self._deadline_s - time.monotonic())

    def invocation_metadata(self):
        return self._metadata

    def set_trailing_metadata(self, metadata) -> None:
        self._trailing = tuple(metadata)

    def is_active(self) -> bool:
        return not self._ended

    # -- the HTTP layer ------------------------------------------------------------------------------------

    def cancel(self) -> None:
        """The client went away: stop the request on every worker."""
        self.cancelled = True
        self._end()

    def done(self) -> None:
        """The response was written (callbacks run, as gRPC runs them when a call ends)."""
        self._end()

    def _end(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._ended = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()


class DisconnectWatcher:
    """Watches a request's socket on a thread and cancels ``ctx`` if the client closes it before ``stop()``.

    Only valid while the client sends nothing more (the request body was read): then the socket turns
    readable only when the peer closed it.
    """

    def __init__(self, sock: socket.socket, ctx: HttpCallContext, poll_s: float = 0.1) -> None:
        self._sock, self._ctx, self._poll_s = sock, ctx, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="http-disconnect", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                readable, _, _ = select.select([self._sock], [], [], self._poll_s)
                gone = bool(readable) and not self._sock.recv(1, socket.MSG_PEEK)
            except (OSError, ValueError):  # reset by the peer (or closed under us once stopped)
                gone = not self._stop.is_set()
            if gone:
                self._ctx.cancel()
                return
