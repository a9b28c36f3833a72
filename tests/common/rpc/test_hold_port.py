"""A worker holds its gRPC port from its start, while its model loads and NIXL starts (tensor-parallel ranks and UCX
listeners take ephemeral ports, and Linux's ephemeral range holds 50051 and every port handed out for port 0): while
held, no other socket binds the port, not even a wildcard one with SO_REUSEADDR as UCX's are; once released the
server binds it."""

from __future__ import annotations

import errno
import socket

import pytest

import services.worker.runtime as runtime
from common.rpc.server import build_server, hold_port
from services.worker.config import WorkerConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_held_port_is_nobody_elses_until_released():
    port = free_port()
    held = hold_port("127.0.0.1", port)
    assert held is not None
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as other:
            other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                other.bind((host, port))
    held.close()
    server, bound, _ = build_server(lambda s: None, [], host="127.0.0.1", port=port)
    try:
        assert bound == port
    finally:
        server.stop(None)


def test_nothing_is_held_for_port_0_or_a_port_in_use():
    assert hold_port("127.0.0.1", 0) is None
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert hold_port("127.0.0.1", taken.getsockname()[1]) is None
    held = hold_port("[::1]", free_port()) if socket.has_ipv6 else None  # brackets as in a gRPC address
    if held is not None:
        assert held.family == socket.AF_INET6
        held.close()


def test_a_worker_holds_its_port_while_its_model_loads(monkeypatch):
    """No other socket gets the port between the worker's first moment and its server's bind; a start that fails
    while loading lets it go."""
    port = free_port()
    seen = []

    def loading(config, role):
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.1", port))
                seen.append("bound")
            except OSError as exc:
                seen.append(exc.errno)
        raise RuntimeError("the load failed")

    monkeypatch.setattr(runtime, "build_engine", loading)
    with pytest.raises(RuntimeError, match="the load failed"):
        runtime.serve_worker("prefill", WorkerConfig(model="unused", port=port), lambda *a: None)
    assert seen == [errno.EADDRINUSE]
    with socket.socket() as after:
        after.bind(("127.0.0.1", port))  # released
