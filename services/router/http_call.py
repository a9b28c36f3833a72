"""The router's gRPC handler driven from HTTP: a stand-in for ``grpc.ServicerContext``.

The OpenAI API and the WebSocket stream run :meth:`RouterServicer.stream` itself (same validation, routing,
retries, metrics, records and traces as gRPC) on the router's event loop, read from the HTTP front's thread
through a :class:`BlockingStream`, with an :class:`HttpCallContext` in place of gRPC's context:

- ``await abort(code, details)`` raises :class:`CallAborted` (the HTTP layer turns it into a status and an
  error);
- ``add_callback(fn)``: ``fn`` runs once when the call ends: the client went away (:meth:`cancel`, called by
  :class:`DisconnectWatcher` or a failed write; the stream's task is cancelled, and with it its calls to the
  workers) or the HTTP layer finished (:meth:`done`);
- ``time_remaining()``: from the ``X-Request-Timeout`` header (seconds), else None (the router's default);
- ``invocation_metadata()``: the HTTP headers a trace continues from (``traceparent``, ``tracestate``);
- the caller's principal, as the HTTP front authenticated it, under ``auth_principal`` like a gRPC context's
  (:func:`common.security.auth.principal_of` reads it; None when auth is off).
"""

from __future__ import annotations

import asyncio
import queue
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing

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

    # -- what RouterServicer.stream uses -----------------------------------------------------------------

    async def abort(self, code: grpc.StatusCode, details: str):
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


class _End:
    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class BlockingStream:
    """An async stream of messages run on ``loop``, read from another thread as a plain iterator. Ending ``ctx``
    early (:meth:`HttpCallContext.cancel`) or :meth:`close` cancels its task: the iterator then raises
    :class:`CallAborted` (CANCELLED). An error the stream raises is raised by the iterator once the messages
    before it were read."""

    def __init__(self, loop: asyncio.AbstractEventLoop, messages: AsyncIterator, ctx: HttpCallContext) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._future = asyncio.run_coroutine_threadsafe(self._pump(messages), loop)
        ctx.add_callback(self.close)

    async def _pump(self, messages: AsyncIterator) -> None:
        try:
            async with aclosing(messages):
                async for message in messages:
                    self._queue.put(message)
        except asyncio.CancelledError:
            self._queue.put(_End(CallAborted(grpc.StatusCode.CANCELLED, "cancelled by the client")))
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the reading thread
            self._queue.put(_End(exc))
        else:
            self._queue.put(_End(None))

    def __iter__(self) -> BlockingStream:
        return self

    def __next__(self):
        item = self._queue.get()
        if isinstance(item, _End):
            self._queue.put(item)  # ended for good: later reads end the same way
            if item.error is not None:
                raise item.error
            raise StopIteration
        return item

    def close(self) -> None:
        """Stop the stream (a no-op once it ended); its cleanup (release KV, records) runs on the loop."""
        self._future.cancel()


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
