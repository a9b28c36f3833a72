"""Server-side WebSocket (RFC 6455) on a call of the HTTP front (:mod:`common.http.server`).

A route handler calls ``ws = accept(request)`` (on :class:`HandshakeError`: ``reject(request, exc)``) and owns
the connection until it returns: the server then closes the socket, so the handler must outlive every thread
using ``ws``. Any number of threads may send (a lock keeps frames whole); one at a time reads. Streaming
pattern: a reader thread calls ``recv()`` until it returns None (the client closed, or the stream ended) while
the handler's thread sends until ``ws.closed`` (``closed_event``); from then on sends raise ConnectionClosed.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import select
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3
OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_OPCODES = {OP_CONT, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG}
CLOSE_WAIT_S = 1.0  # how long a closing side waits for the peer's close frame (or end of stream)


class WebSocketError(Exception):
    """A WebSocket operation failed."""


class ConnectionClosed(WebSocketError):
    """The connection is closing or closed: nothing more can be sent."""


class HandshakeError(WebSocketError):
    """The upgrade request is not a valid WebSocket handshake; ``status`` and ``headers`` are the HTTP answer."""

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})


class _Fail(Exception):
    """The peer broke the protocol: fail the connection with close ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


def _valid_close_code(code: int) -> bool:
    """Whether an endpoint may send ``code`` in a close frame (RFC 6455 section 7.4)."""
    return 1000 <= code <= 1003 or 1007 <= code <= 1014 or 3000 <= code <= 4999


def _tokens(value: str | None) -> set[str]:
    return {token.strip().lower() for token in (value or "").split(",")}


def accept_key(key: str) -> str:
    """The ``Sec-WebSocket-Accept`` answer to a ``Sec-WebSocket-Key``."""
    return base64.b64encode(hashlib.sha1(key.encode() + _GUID).digest()).decode()


def accept(request: BaseHTTPRequestHandler, *, max_message_bytes: int = 1 << 20) -> WebSocket:
    """Validate the upgrade request, answer ``101 Switching Protocols`` and return the connection's WebSocket.

    Raises :class:`HandshakeError` (status 400; 426 when ``Sec-WebSocket-Version`` is not 13) having
    written nothing: the caller answers (see :func:`reject`). On success the HTTP server handles no further
    request on this connection.
    """
    headers = request.headers
    if (request.command, request.request_version) != ("GET", "HTTP/1.1"):
        raise HandshakeError(f"a WebSocket upgrade is GET HTTP/1.1, not {request.command} {request.request_version}")
    if "websocket" not in _tokens(headers.get("Upgrade")):
        raise HandshakeError(f"Upgrade header {headers.get('Upgrade')!r} does not name websocket")
    if "upgrade" not in _tokens(headers.get("Connection")):
        raise HandshakeError(f"Connection header {headers.get('Connection')!r} does not name upgrade")
    version = headers.get("Sec-WebSocket-Version")
    if (version or "").strip() != "13":
        raise HandshakeError(f"Sec-WebSocket-Version {version!r} is not 13", 426, {"Sec-WebSocket-Version": "13"})
    key = (headers.get("Sec-WebSocket-Key") or "").strip()
    try:
        raw_key = base64.b64decode(key, validate=True)
    except ValueError:  # binascii.Error
        raw_key = b""
    if len(raw_key) != 16:
        raise HandshakeError(f"Sec-WebSocket-Key {key!r} is not 16 bytes in base64")
    request.send_response(101)
    request.send_header("Upgrade", "websocket")
    request.send_header("Connection", "Upgrade")
    request.send_header("Sec-WebSocket-Accept", accept_key(key))
    request.end_headers()
    request.close_connection = True
    sock = request.connection
    sock.setblocking(False)  # take what the HTTP parser read ahead (a pipelining client's first frames)
    early = request.rfile.read1(1 << 16) or b""
    sock.settimeout(None)
    return WebSocket(sock, early, max_message_bytes=max_message_bytes)


def reject(request: BaseHTTPRequestHandler, error: HandshakeError) -> None:
    """Answer a failed handshake: ``error.status``, ``error.headers`` and a JSON error body."""
    body = json.dumps({"error": {"message": str(error), "type": "invalid_request_error", "code": error.status}},
                      separators=(",", ":")).encode()
    request.send_response(error.status)
    for name, value in error.headers.items():
        request.send_header(name, value)
    request.send_header("Content-Type", "application/json")
    request.send_header("Content-Length", str(len(body)))
    request.end_headers()
    request.wfile.write(body)


def _unmask(payload: bytes, mask: bytes) -> bytes:
    n = len(payload)
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(n, "big")


class WebSocket:
    """One server-side WebSocket on a connected socket (blocking mode); see the module docstring for threads.

    ``closed_event`` is set once either side started closing or the connection broke; ``close_code`` is the
    code of the first close frame received or sent (1005: one without a code; None: none, e.g. the peer vanished).
    """

    def __init__(self, sock: socket.socket, early: bytes = b"", *, max_message_bytes: int = 1 << 20) -> None:
        self.max_message_bytes = max_message_bytes
        self.closed_event = threading.Event()
        self.close_code: int | None = None
        self._sock = sock
        self._buffer = bytearray(early)  # received bytes not yet parsed
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._close_sent = False
        self._close_received = threading.Event()  # the peer's close frame arrived or the stream ended
        self._message = bytearray()  # fragments of the message being received; kept across recv() timeouts
        self._message_opcode: int | None = None

    @property
    def closed(self) -> bool:
        return self.closed_event.is_set()

    def send_text(self, text: str) -> None:
        self._send(OP_TEXT, text.encode())

    def send_bytes(self, data: bytes) -> None:
        self._send(OP_BINARY, bytes(data))

    def send_json(self, obj) -> None:
        self.send_text(json.dumps(obj, separators=(",", ":")))

    def recv(self, timeout_s: float | None = None) -> str | bytes | None:
        """The next whole message (text: str, binary: bytes), or None once the peer closed or the stream ended.

        Answers pings, drops pongs, and echoes the peer's close frame. ``timeout_s`` bounds the wait for each
        frame's first bytes only; on :class:`TimeoutError` nothing is lost and the connection stays usable.
        A protocol error closes the connection (1002; 1007 for bad UTF-8; 1009 for a message over
        ``max_message_bytes``) and returns None once the peer hung up (at most CLOSE_WAIT_S later). Callers
        are serialised; a call may wait up to CLOSE_WAIT_S while ``close()`` reads the peer's close frame.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._recv_lock:
            while not self._close_received.is_set():
                try:
                    message = self._next_message(deadline)
                except TimeoutError:
                    raise
                except _Fail as fail:
                    self._fail(fail.code, fail.reason)
                except (EOFError, OSError):
                    self._broken()
                else:
                    if message is not None and not self._close_sent:  # data after our close frame is dropped
                        return message
            return None

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Send a close frame (only the first call does anything), wait up to CLOSE_WAIT_S for the peer's (read
        here unless another thread is in recv()), then shut the socket down. ValueError: a code an endpoint
        may not send, or a reason over 123 bytes in UTF-8."""
        if not _valid_close_code(code) or len(reason.encode()) > 123:
            raise ValueError(f"invalid close code {code} or reason {reason!r} (at most 123 bytes)")
        if not self._send_close(code, reason):
            return
        deadline = time.monotonic() + CLOSE_WAIT_S
        if self._recv_lock.acquire(blocking=False):
            try:
                while not self._close_received.is_set():
                    if self._read_frame(deadline, self.max_message_bytes, deadline)[1] == OP_CLOSE:
                        self._close_received.set()
            except (_Fail, EOFError, OSError):  # TimeoutError included
                pass
            finally:
                self._recv_lock.release()
        else:
            self._close_received.wait(max(0.0, deadline - time.monotonic()))
        self._shutdown(socket.SHUT_RDWR)

    def _send(self, opcode: int, payload: bytes) -> None:
        with self._send_lock:
            if self.closed_event.is_set():
                raise ConnectionClosed(f"the WebSocket is closed (code {self.close_code})")
            try:
                self._send_frame(opcode, payload)
            except OSError as exc:
                self._broken()
                raise ConnectionClosed(f"the connection broke: {exc}") from exc

    def _send_frame(self, opcode: int, payload: bytes) -> None:  # caller holds _send_lock; server frames unmasked
        n = len(payload)
        if n < 126:
            header = struct.pack("!BB", 0x80 | opcode, n)
        elif n < 1 << 16:
            header = struct.pack("!BBH", 0x80 | opcode, 126, n)
        else:
            header = struct.pack("!BBQ", 0x80 | opcode, 127, n)
        self._sock.sendall(header + payload)

    def _send_close(self, code: int | None, reason: str) -> bool:
        """Send the close frame (no code: empty payload) unless one was sent; True if this call sent it."""
        with self._send_lock:
            if self._close_sent:
                return False
            self._close_sent = True
            self.closed_event.set()
            if self.close_code is None:
                self.close_code = code or 1005
            payload = b"" if code is None else struct.pack("!H", code) + reason.encode()[:123]
            with contextlib.suppress(OSError):
                self._send_frame(OP_CLOSE, payload)
            return True

    def _next_message(self, deadline: float | None) -> str | bytes | None:
        """Read frames until a whole data message (returned) or the peer's close frame (None)."""
        while True:
            fin, opcode, payload = self._read_frame(deadline, self.max_message_bytes - len(self._message), None)
            if opcode == OP_PING:
                with contextlib.suppress(ConnectionClosed):
                    self._send(OP_PONG, payload)
            elif opcode == OP_CLOSE:
                self._on_close(payload)
                return None
            elif opcode != OP_PONG:
                if (opcode == OP_CONT) != (self._message_opcode is not None):
                    raise _Fail(1002, "continuation frame without a message" if opcode == OP_CONT
                                else "new message inside a fragmented one")
                self._message_opcode = opcode if opcode != OP_CONT else self._message_opcode
                self._message += payload
                if fin:
                    kind, data = self._message_opcode, bytes(self._message)
                    self._message, self._message_opcode = bytearray(), None
                    if kind == OP_BINARY:
                        return data
                    try:
                        return data.decode("utf-8")
                    except UnicodeDecodeError:
                        raise _Fail(1007, "invalid UTF-8 in a text message") from None

    def _read_frame(self, deadline: float | None, limit_bytes: int, rest_deadline: float | None):
        """(fin, opcode, unmasked payload) of the next frame. ``deadline`` bounds the wait for its first two
        bytes (nothing is consumed on timeout), ``rest_deadline`` the rest; a data frame over ``limit_bytes``
        fails with 1009 before its payload is read."""
        b0, b1 = self._read_exact(2, deadline)
        fin, opcode, n = bool(b0 & 0x80), b0 & 0x0F, b1 & 0x7F
        if b0 & 0x70 or opcode not in _OPCODES:
            raise _Fail(1002, f"reserved bits or unknown opcode in frame byte {b0:#04x}")
        if not b1 & 0x80:
            raise _Fail(1002, "client frames must be masked")
        if n == 126:
            (n,) = struct.unpack("!H", self._read_exact(2, rest_deadline))
        elif n == 127:
            (n,) = struct.unpack("!Q", self._read_exact(8, rest_deadline))
        if opcode >= OP_CLOSE and (n > 125 or not fin):
            raise _Fail(1002, "control frame fragmented or over 125 bytes")
        if opcode < OP_CLOSE and n > limit_bytes:
            raise _Fail(1009, f"message over {self.max_message_bytes} bytes")
        mask = self._read_exact(4, rest_deadline)
        return fin, opcode, _unmask(self._read_exact(n, rest_deadline), mask)

    def _read_exact(self, n: int, deadline: float | None) -> bytes:
        while len(self._buffer) < n:
            self._wait_readable(deadline)
            chunk = self._sock.recv(max(n - len(self._buffer), 1 << 16))
            if not chunk:
                raise EOFError("the connection ended")
            self._buffer += chunk
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    def _wait_readable(self, deadline: float | None) -> None:
        if deadline is None:
            return
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0 or not poller.poll(remaining_s * 1000):
            raise TimeoutError("no WebSocket frame before the deadline")

    def _on_close(self, payload: bytes) -> None:
        code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else None
        if len(payload) == 1 or code is not None and not _valid_close_code(code):
            raise _Fail(1002, f"invalid close frame payload {payload[:2]!r}")
        try:
            payload[2:].decode("utf-8")
        except UnicodeDecodeError:
            raise _Fail(1007, "invalid UTF-8 in a close reason") from None
        if self.close_code is None:
            self.close_code = code or 1005
        self._close_received.set()
        self.closed_event.set()
        self._send_close(code, "")  # echo the peer's code; nothing when we sent ours first
        self._shutdown(socket.SHUT_WR)

    def _fail(self, code: int, reason: str) -> None:
        """Close with ``code``, then discard what the peer still sends until it ends the stream (or CLOSE_WAIT_S)."""
        self._send_close(code, reason)
        self._shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + CLOSE_WAIT_S
        self._buffer.clear()
        with contextlib.suppress(OSError):  # TimeoutError included
            while self._wait_readable(deadline) or self._sock.recv(1 << 16):
                pass
        self._broken()

    def _broken(self) -> None:
        self._close_received.set()
        self.closed_event.set()
        self._shutdown(socket.SHUT_RDWR)

    def _shutdown(self, how: int) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(how)
