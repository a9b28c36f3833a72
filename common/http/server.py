"""A service's HTTP front: ``/metrics`` (Prometheus), ``/healthz`` (alive), ``/readyz`` (ready for traffic).

The router's front (``--http-port``) will carry the OpenAI-compatible API too, so routes are registered, not
hard-wired: ``front.route("GET", "/v1/models", handler)``, where ``handler(request)`` gets the
:class:`http.server.BaseHTTPRequestHandler` of the call and writes the whole response itself (helpers:
:func:`send_json`, :func:`send_bytes`). Each call runs on its own thread.

Health contract (every service):

- ``GET /healthz``: 200 while the process serves HTTP at all, with ``{"status": "alive", ...details}``;
- ``GET /readyz``: 200 ``{"status": "ready", ...details}`` when the service should get traffic (model loaded,
  registered, not stopping), else 503 ``{"status": "not ready", "reasons": [...], ...details}``.

``details`` is the service's own figures (a decode worker's KV usage, a prefill worker's queue, ...).

Authentication (``HttpFront(..., authenticator=...)``, see :mod:`common.security.auth`): when set, every route
except :data:`OPEN_PATHS` (``/healthz``, ``/readyz``, ``/metrics``: probes and scrapes) needs
``Authorization: Bearer <token>`` (or ``X-API-Key: <key>``), checked before the route is looked up. A refused
request gets 401 with ``WWW-Authenticate: Bearer`` and OpenAI's error shape
``{"error": {"message": REASON, "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}``
(the connection is then closed: an unread body is not parsed as the next request). An accepted one reaches its
handler with the caller's principal on the request object (``principal_of(request)``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from common.security.auth import PRINCIPAL_ATTR, Authenticator, credential_of
from common.security.errors import AuthError

log = logging.getLogger(__name__)
CLIENT_TIMEOUT_S = 60.0  # see HttpFront.__init__
OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})  # never need a credential, even with auth on

Handler = Callable[[BaseHTTPRequestHandler], None]
ReadyFn = Callable[[], list[str]]  # why the service is not ready; [] = ready
DetailsFn = Callable[[], dict]


def send_bytes(request: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
    request.send_response(status)
    request.send_header("Content-Type", content_type)
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    if request.command != "HEAD":
        request.wfile.write(body)


def send_json(request: BaseHTTPRequestHandler, status: int, obj) -> None:
    send_bytes(request, status, json.dumps(obj, separators=(",", ":")).encode(), "application/json")


def send_unauthorized(request: BaseHTTPRequestHandler, reason: str) -> None:
    """401 with ``WWW-Authenticate: Bearer`` and OpenAI's invalid-API-key error (the body shape of
    ``services.router.openai_protocol.OpenAIError.body()``); closes the connection after it."""
    body = json.dumps({"error": {"message": reason, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}}, separators=(",", ":")).encode()  # fmt: skip
    request.send_response(401)
    request.send_header("WWW-Authenticate", "Bearer")
    request.send_header("Content-Type", "application/json")
    request.send_header("Content-Length", str(len(body)))
    request.send_header("Connection", "close")
    request.end_headers()
    request.close_connection = True
    if request.command != "HEAD":
        request.wfile.write(body)


class HttpFront:
    """An HTTP server on its own threads; start() binds (port 0 = any free port) and returns the port.
    ``authenticator``: None = every route open; else all but :data:`OPEN_PATHS` need a credential."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, authenticator: Authenticator | None = None,
                 client_timeout_s: float = CLIENT_TIMEOUT_S) -> None:
        """``client_timeout_s``: longest wait on a client's socket (an idle keep-alive connection, a request
        line, headers or body that stop arriving, a response the client stops reading); past it the connection
        is closed, so a stalled client cannot hold a server thread. WebSocket connections set their own."""
        self.host, self.port = host, port
        self.authenticator = authenticator
        self.client_timeout_s = client_timeout_s
        self._routes: dict[tuple[str, str], Handler] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def route(self, method: str, path: str, handler: Handler) -> None:
        self._routes[(method.upper(), path)] = handler

    def add_observability(self, registry: CollectorRegistry, ready: ReadyFn, details: DetailsFn) -> None:
        """Register ``/metrics`` (``registry``), ``/healthz`` and ``/readyz``."""

        def metrics(request):
            send_bytes(request, 200, generate_latest(registry), CONTENT_TYPE_LATEST)

        def healthz(request):
            send_json(request, 200, {"status": "alive", **details()})

        def readyz(request):
            reasons = ready()
            body = {"status": "not ready" if reasons else "ready", **details()}
            if reasons:
                body["reasons"] = reasons
            send_json(request, 503 if reasons else 200, body)

        for path, fn in (("/metrics", metrics), ("/healthz", healthz), ("/readyz", readyz)):
            self.route("GET", path, fn)
            self.route("HEAD", path, fn)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> int:
        routes, authenticator = self._routes, self.authenticator

        class _Request(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "pdserve"
            timeout = self.client_timeout_s  # the socket's timeout (StreamRequestHandler.setup)

            def _dispatch(self) -> None:
                setattr(self, PRINCIPAL_ATTR, None)  # one handler object serves every request of a connection
                if authenticator is not None and urlsplit(self.path).path not in OPEN_PATHS:
                    try:
                        principal = authenticator.authenticate(credential_of(self.headers.items()))
                    except AuthError as exc:
                        log.info("refused HTTP %s %s: %s", self.command, urlsplit(self.path).path, exc.reason)
                        try:
                            send_unauthorized(self, exc.reason)
                        except OSError:  # the client went away
                            pass
                        return
                    setattr(self, PRINCIPAL_ATTR, principal)
                handler = routes.get((self.command, urlsplit(self.path).path))
                if handler is None:
                    known = {p for (_, p) in routes}
                    code = 405 if urlsplit(self.path).path in known else 404
                    send_json(self, code, {"error": {"message": f"no route {self.command} {self.path}",
                                                     "type": "not_found" if code == 404 else "method_not_allowed",
                                                     "code": code}})
                    return
                try:
                    handler(self)
                except (BrokenPipeError, ConnectionResetError, TimeoutError):  # the client went away or stalled
                    self.close_connection = True
                except Exception:  # noqa: BLE001 - one broken call must not take the server down
                    log.exception("HTTP %s %s failed", self.command, self.path)
                    try:
                        send_json(self, 500, {"error": {"message": "internal error", "type": "server_error",
                                                        "code": 500}})
                    except OSError:
                        pass

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _dispatch

            def log_message(self, format, *args):  # noqa: A002 - the base class's name
                log.debug("http %s - %s", self.address_string(), format % args)

        try:
            self._server = ThreadingHTTPServer((self.host, self.port), _Request)
        except OSError as exc:  # the OS's errno stays (EADDRINUSE: `pdserve up` tries other ports), with the port
            message = f"cannot listen for HTTP on {self.host}:{self.port}: {exc.strerror or exc}"
            raise (OSError(exc.errno, message) if exc.errno else OSError(message)) from exc
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="http-front", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        """Stop serving and close the socket. Idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
