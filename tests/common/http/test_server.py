from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from common.http.server import HttpFront, send_json


def fetch(url: str, method: str = "GET") -> tuple[int, str, str]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.headers["Content-Type"], reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


@pytest.fixture
def front():
    registry = CollectorRegistry()
    Counter("pdserve:things", "Things.", registry=registry).inc(3)
    reasons: list[str] = []
    front = HttpFront("127.0.0.1", 0)
    front.add_observability(registry, lambda: list(reasons), lambda: {"queue": 2})
    front.route("POST", "/echo", lambda req: send_json(req, 201, {"path": req.path}))
    front.route("GET", "/boom", lambda req: 1 / 0)
    front.start()
    yield front, reasons
    front.stop()
    front.stop()  # idempotent


def test_metrics_health_and_readiness(front):
    front, reasons = front
    base = f"http://{front.address}"
    code, ctype, body = fetch(f"{base}/metrics")
    assert code == 200 and ctype.startswith("text/plain") and "pdserve:things_total 3.0" in body
    assert fetch(f"{base}/healthz")[::2] == (200, '{"status":"alive","queue":2}')
    assert json.loads(fetch(f"{base}/readyz")[2]) == {"status": "ready", "queue": 2}
    reasons.append("draining")
    code, _, body = fetch(f"{base}/readyz")
    assert code == 503 and json.loads(body) == {"status": "not ready", "queue": 2, "reasons": ["draining"]}
    assert fetch(f"{base}/healthz")[0] == 200  # alive while not ready


def test_routes_unknown_paths_and_failing_handlers(front):
    front, _ = front
    base = f"http://{front.address}"
    assert fetch(f"{base}/echo?x=1", "POST")[::2] == (201, '{"path":"/echo?x=1"}')
    assert fetch(f"{base}/echo")[0] == 405
    code, _, body = fetch(f"{base}/missing")
    assert code == 404 and json.loads(body)["error"]["code"] == 404
    code, _, body = fetch(f"{base}/boom")
    assert code == 500 and json.loads(body)["error"]["type"] == "server_error"
    assert fetch(f"{base}/metrics")[0] == 200  # still serving


def test_a_stalled_client_is_dropped_after_the_client_timeout():
    import socket
    import time

    http = HttpFront(client_timeout_s=0.5)
    http.route("POST", "/echo", lambda request: send_json(
        request, 200, json.loads(request.rfile.read(int(request.headers["Content-Length"])))))
    http.start()
    try:
        stalls = [b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"a\":",  # body stops
                  b"POST /echo HTTP/1.1\r\nHost: x\r\n",  # headers stop
                  b""]  # idle connection
        for sent in stalls:
            with socket.create_connection(("127.0.0.1", http.port), timeout=10) as sock:
                sock.sendall(sent)
                t0 = time.monotonic()
                while sock.recv(4096):  # the server closes it (after an error answer, if any)
                    pass
                assert 0.4 < time.monotonic() - t0 < 5, sent
        body = json.dumps({"a": 1}).encode()  # a client that keeps up is served as before
        request = urllib.request.Request(f"http://{http.address}/echo", body, method="POST")
        with urllib.request.urlopen(request, timeout=5) as reply:
            assert json.loads(reply.read()) == {"a": 1}
    finally:
        http.stop()
