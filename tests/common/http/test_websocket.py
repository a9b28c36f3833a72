from __future__ import annotations

import base64
import http.client
import json
import os
import queue
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import pytest
from websockets.exceptions import ConnectionClosedError, ConnectionClosedOK
from websockets.sync.client import connect

from common.http.server import HttpFront
from common.http.websocket import ConnectionClosed, HandshakeError, WebSocket, accept, accept_key, reject


def _upgrade(request, **kwargs):
    try:
        return accept(request, **kwargs)
    except HandshakeError as exc:
        reject(request, exc)
        return None


def _echo(request, records, max_message_bytes=1 << 20):
    ws = _upgrade(request, max_message_bytes=max_message_bytes)
    if ws is None:
        return
    try:
        while (message := ws.recv(timeout_s=5)) is not None:
            (ws.send_text if isinstance(message, str) else ws.send_bytes)(message)
    except TimeoutError:
        ws.close(1001)
    records.put(ws.close_code)


def _stream(request, records):
    ws = accept(request)
    for i in range(5):
        ws.send_json({"i": i})
    started = time.monotonic()
    ws.close(4001, "stream done")
    close_s = time.monotonic() - started
    ws.close(1000)  # no-op
    try:
        ws.send_json({"late": True})
        late = "sent"
    except ConnectionClosed:
        late = "ConnectionClosed"
    records.put({"close_s": close_s, "close_code": ws.close_code, "closed": ws.closed, "late": late})


def _hangup(request, records):
    """The server closes while a reader thread is in recv(): close() waits on the reader, not the socket."""
    ws = accept(request)
    reader_got = []
    thread = threading.Thread(target=lambda: reader_got.append(ws.recv(timeout_s=5)), daemon=True)
    thread.start()
    ws.send_json({"bye": True})
    started = time.monotonic()
    ws.close(1001, "shutting down")
    close_s = time.monotonic() - started
    thread.join(5)
    records.put({"close_s": close_s, "reader_got": reader_got, "close_code": ws.close_code})


def _fanout(request, records):
    ws = accept(request)
    senders = [threading.Thread(target=lambda t=t: [ws.send_json({"t": t, "i": i}) for i in range(100)])
               for t in range(4)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(5)
    ws.close()
    records.put(ws.close_code)


def _watch(request, records):
    """The router's pattern: stream from the handler's thread, detect the client's close on a reader thread."""
    ws = accept(request)
    seen: dict = {}

    def reader():
        while (message := ws.recv(timeout_s=5)) is not None:
            seen.setdefault("messages", []).append(message)
        seen["closed_at"] = time.monotonic()
        seen["closed_event"] = ws.closed_event.is_set()

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    num_sent = num_sent_after_close = 0
    give_up_at = time.monotonic() + 5
    while time.monotonic() < give_up_at:
        try:
            ws.send_json({"i": num_sent})
        except ConnectionClosed:
            break
        num_sent += 1
        num_sent_after_close += "closed_at" in seen
        time.sleep(0.002)
    stopped_at = time.monotonic()
    thread.join(5)
    try:
        ws.send_json({"late": True})
        late = "sent"
    except ConnectionClosed:
        late = "ConnectionClosed"
    records.put({**seen, "stopped_at": stopped_at, "num_sent_after_close": num_sent_after_close, "late": late,
                 "close_code": ws.close_code})


def _timeout(request, records):
    ws = accept(request)
    try:
        ws.recv(timeout_s=0.15)
        outcome = "message"
    except TimeoutError:
        outcome = "timeout"
    ws.send_text(f"{outcome}:{ws.recv(timeout_s=2)}")
    records.put(ws.recv(timeout_s=2))


@pytest.fixture(scope="module")
def front_and_holder():
    holder: dict = {}
    front = HttpFront("127.0.0.1", 0)
    routes = {"/echo": _echo, "/small": lambda r, q: _echo(r, q, max_message_bytes=1000), "/stream": _stream,
              "/hangup": _hangup, "/fanout": _fanout, "/watch": _watch, "/timeout": _timeout}
    for path, fn in routes.items():
        front.route("GET", path, lambda request, fn=fn: fn(request, holder["records"]))
    front.start()
    yield front, holder
    front.stop()


@pytest.fixture
def server(front_and_holder):
    """(address, records): each handler puts one record when it is done."""
    front, holder = front_and_holder
    holder["records"] = queue.Queue()
    return front.address, holder["records"]


def _connect(address: str, path: str):
    return connect(f"ws://{address}{path}", open_timeout=2, close_timeout=2)


def _raw_connect(address: str, first_frames: bytes = b"") -> socket.socket:
    """Handshake by hand (sending ``first_frames`` right behind the request); returns the socket after the 101."""
    host, port = address.split(":")
    sock = socket.create_connection((host, int(port)), timeout=2)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET /echo HTTP/1.1\r\nHost: {address}\r\nUpgrade: websocket\r\nConnection: keep-alive, Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode() + first_frames)
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += sock.recv(1)  # byte by byte: leave the frames in the socket
    assert head.startswith(b"HTTP/1.1 101 Switching Protocols\r\n")
    assert f"Sec-WebSocket-Accept: {accept_key(key)}\r\n".encode() in head
    return sock


def _read_to_end(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    return data


def _masked(first_byte: int, payload: bytes, mask: bytes = b"\x0a\x0b\x0c\x0d") -> bytes:
    return bytes([first_byte, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _close_frame(code: int, reason: str) -> bytes:
    return bytes([0x88, 2 + len(reason)]) + struct.pack("!H", code) + reason.encode()


def test_accept_key_matches_the_rfc_example():
    assert accept_key("dGhlIHNhbXBsZSBub25jZQ==") == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


def test_echo_text_binary_fragments_large_messages_and_ping(server):
    address, records = server
    blob = os.urandom(200_000)
    with _connect(address, "/echo") as ws:
        ws.send("héllo")
        assert ws.recv(timeout=2) == "héllo"
        ws.send(b"\x00\x01\xff")
        assert ws.recv(timeout=2) == b"\x00\x01\xff"
        ws.send(["hel", "lo ", "world"])  # three frames: text + 2 continuations
        assert ws.recv(timeout=2) == "hello world"
        ws.send([b"ab", b"cd"])
        assert ws.recv(timeout=2) == b"abcd"
        ws.send("x" * 200_000)
        assert ws.recv(timeout=2) == "x" * 200_000
        ws.send(blob)
        assert ws.recv(timeout=2) == blob
        assert ws.ping(b"are you there").wait(2)
        ws.send("still here")
        assert ws.recv(timeout=2) == "still here"
    assert records.get(timeout=2) == 1000  # the client's close, echoed


def test_server_close_reaches_the_client_with_code_and_reason(server):
    address, records = server
    received = []
    with _connect(address, "/stream") as ws:
        with pytest.raises(ConnectionClosedError) as closed:
            while True:
                received.append(json.loads(ws.recv(timeout=2)))
        assert (ws.close_code, ws.close_reason) == (4001, "stream done")
    assert received == [{"i": i} for i in range(5)]
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4001, "stream done")
    record = records.get(timeout=2)
    assert record["close_s"] < 0.5  # the client's close frame ended the wait, not the 1 s bound
    assert (record["close_code"], record["closed"], record["late"]) == (4001, True, "ConnectionClosed")


def test_server_close_while_a_reader_thread_waits(server):
    address, records = server
    with _connect(address, "/hangup") as ws:
        assert json.loads(ws.recv(timeout=2)) == {"bye": True}
        with pytest.raises(ConnectionClosedOK) as closed:
            ws.recv(timeout=2)
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1001, "shutting down")
    record = records.get(timeout=2)
    assert record["close_s"] < 0.5 and record["reader_got"] == [None] and record["close_code"] == 1001


def test_concurrent_senders_keep_frames_whole(server):
    address, records = server
    with _connect(address, "/fanout") as ws:
        received = [json.loads(message) for message in ws]  # ends at the server's close 1000
    for t in range(4):
        assert [m["i"] for m in received if m["t"] == t] == list(range(100))
    assert len(received) == 400 and records.get(timeout=2) == 1000


def test_reader_thread_sees_client_close_promptly_and_streaming_stops(server):
    address, records = server
    with _connect(address, "/watch") as ws:
        assert [json.loads(ws.recv(timeout=2)) for _ in range(3)] == [{"i": 0}, {"i": 1}, {"i": 2}]
        ws.send("cancel?")
        close_started_at = time.monotonic()
        ws.close()
    record = records.get(timeout=5)
    assert record["messages"] == ["cancel?"]
    assert record["closed_at"] - close_started_at < 0.5 and record["closed_event"] is True
    assert record["stopped_at"] - close_started_at < 0.5
    assert record["num_sent_after_close"] <= 1  # at most one send raced the close
    assert (record["late"], record["close_code"]) == ("ConnectionClosed", 1000)


def test_recv_timeout_keeps_the_connection_and_partial_message(server):
    address, records = server

    def slow_fragments():
        yield "a"
        time.sleep(0.3)  # the server's recv(timeout_s=0.15) expires between the fragments
        yield "b"

    with _connect(address, "/timeout") as ws:
        ws.send(slow_fragments())
        assert ws.recv(timeout=2) == "timeout:ab"
    assert records.get(timeout=2) is None  # the last recv() saw the client's close


def test_message_over_the_limit_closes_with_1009(server):
    address, records = server
    with _connect(address, "/small") as ws:
        ws.send("y" * 1000)  # exactly the limit
        assert ws.recv(timeout=2) == "y" * 1000
        ws.send("y" * 1001)
        with pytest.raises(ConnectionClosedError) as closed:
            ws.recv(timeout=2)
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1009, "message over 1000 bytes")
    assert records.get(timeout=2) == 1009


def test_unmasked_frame_closes_with_1002(server):
    address, records = server
    with _raw_connect(address) as sock:
        sock.sendall(b"\x81\x02hi")  # FIN + text, no mask bit
        assert _read_to_end(sock) == _close_frame(1002, "client frames must be masked")
    assert records.get(timeout=2) == 1002


@pytest.mark.parametrize("frame, code, reason", [
    (_masked(0xC1, b"hi"), 1002, "reserved bits or unknown opcode in frame byte 0xc1"),
    (_masked(0x83, b"hi"), 1002, "reserved bits or unknown opcode in frame byte 0x83"),
    (_masked(0x81, b"\xff\xfe"), 1007, "invalid UTF-8 in a text message"),
    (_masked(0x80, b"hi"), 1002, "continuation frame without a message"),
    (_masked(0x01, b"a") + _masked(0x81, b"b"), 1002, "new message inside a fragmented one"),
    (_masked(0x09, b"hi"), 1002, "control frame fragmented or over 125 bytes"),
    (_masked(0x88, struct.pack("!H", 1005)), 1002, "invalid close frame payload b'\\x03\\xed'"),
], ids=["rsv1", "opcode-3", "bad-utf8", "stray-continuation", "interleaved-message", "fragmented-ping",
        "close-1005"])
def test_protocol_errors_close_with_their_code(server, frame, code, reason):
    address, records = server
    with _raw_connect(address) as sock:
        sock.sendall(frame)
        assert _read_to_end(sock) == _close_frame(code, reason)
    assert records.get(timeout=2) == code


def test_frames_sent_right_behind_the_handshake_are_not_lost(server):
    address, records = server
    with _raw_connect(address, _masked(0x81, b"early")) as sock:
        sock.sendall(_masked(0x88, struct.pack("!H", 1000)))
        assert _read_to_end(sock) == b"\x81\x05early" + _close_frame(1000, "")  # unmasked, 7-bit lengths
    assert records.get(timeout=2) == 1000


def test_bad_handshakes_get_400_or_426(server):
    address, _ = server
    with pytest.raises(urllib.error.HTTPError) as plain:
        urllib.request.urlopen(f"http://{address}/echo", timeout=2)
    assert plain.value.code == 400
    assert json.loads(plain.value.read())["error"]["message"] == "Upgrade header None does not name websocket"

    conn = http.client.HTTPConnection(address, timeout=2)
    conn.request("GET", "/echo", headers={"Upgrade": "websocket", "Connection": "Upgrade",
                                          "Sec-WebSocket-Key": base64.b64encode(b"k" * 16).decode(),
                                          "Sec-WebSocket-Version": "8"})
    reply = conn.getresponse()
    assert (reply.status, reply.getheader("Sec-WebSocket-Version")) == (426, "13")
    reply.read()
    conn.request("GET", "/echo", headers={"Upgrade": "websocket", "Connection": "Upgrade",
                                          "Sec-WebSocket-Key": "c2hvcnQ=", "Sec-WebSocket-Version": "13"})
    reply = conn.getresponse()
    assert reply.status == 400 and b"is not 16 bytes in base64" in reply.read()
    conn.close()


def test_server_frames_use_the_shortest_length_encoding():
    ours, peer = socket.socketpair()
    with ours, peer:
        ws = WebSocket(ours)
        peer.settimeout(2)
        for size, header in [(125, b"\x82\x7d"), (126, b"\x82\x7e\x00\x7e"), (65535, b"\x82\x7e\xff\xff"),
                             (65536, b"\x82\x7f" + struct.pack("!Q", 65536))]:
            ws.send_bytes(b"z" * size)
            data = b""
            while len(data) < len(header) + size:
                data += peer.recv(1 << 17)
            assert data == header + b"z" * size


def test_close_rejects_codes_an_endpoint_may_not_send():
    ours, peer = socket.socketpair()
    with ours, peer:
        ws = WebSocket(ours)
        peer.settimeout(2)
        for code, reason in [(1005, ""), (999, ""), (5000, ""), (1000, "r" * 124)]:
            with pytest.raises(ValueError, match=f"invalid close code {code}"):
                ws.close(code, reason)
        assert not ws.closed  # nothing was sent
        ws.send_text("still open")
        assert peer.recv(64) == b"\x81\x0astill open"
