"""Ports and readiness probes for a local cluster: pick a free port, wait until a service listens.

Called by ``pdserve up`` (and tests) while starting processes. Every wait is bounded by its ``timeout_s``
(each probe uses a short per-attempt timeout, cut to what is left of the deadline), returns a bool, and
never raises for a service that is down, slow or hung.
"""

from __future__ import annotations

import socket
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.rpc.tls import TlsFiles, open_channel

POLL_INTERVAL_S = 0.05  # pause between failed probes
PROBE_TIMEOUT_S = 1.0  # most one probe (connect or RPC) may take
_AVOIDED_PORTS = frozenset({6379})  # Redis's default: never hand it out, so a developer's Redis is never hit

# A health probe's channel reconnects quickly: with gRPC's default backoff (1 s, growing to 120 s) a
# channel that failed while the server was still loading would keep failing long after it listens.
_PROBE_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 250),
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it; never 6379).

    Another process may take it before the caller binds it: bind soon, and treat a bind failure as retryable.
    """
    while True:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _AVOIDED_PORTS:
            return port


def wait_for_tcp(host: str, port: int, timeout_s: float) -> bool:
    """True as soon as a TCP connection to ``host:port`` succeeds; False once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            return False
        try:
            with socket.create_connection((host, port), timeout=min(PROBE_TIMEOUT_S, remaining_s)):
                return True
        except OSError:
            pass
        _sleep_until_next_probe(deadline)


def wait_for_grpc_health(address: str, timeout_s: float, service: str = "", tls: TlsFiles | None = None) -> bool:
    """True as soon as the ``grpc.health.v1`` ``Check`` at ``address`` (``host:port``) answers SERVING for
    ``service`` ("" = the server as a whole); False once ``timeout_s`` has passed. ``tls``: dial with mutual
    TLS (a worker started with ``--tls-*`` answers nothing else); None: plaintext. A bad TLS file raises
    ValueError at once.

    Polls: an unreachable server, an unknown service, NOT_SERVING or a server that accepts connections and
    never answers all mean "not yet". Blocks the calling thread at most about ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    request = health_pb2.HealthCheckRequest(service=service)
    with open_channel(address, tls, _PROBE_CHANNEL_OPTIONS) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            remaining_s = deadline - time.monotonic()
            if remaining_s <= 0:
                return False
            try:
                # wait_for_ready: an RPC waits (within its timeout) for the connection instead of failing
                # at once while the channel is between reconnect attempts.
                response = stub.Check(request, timeout=min(PROBE_TIMEOUT_S, remaining_s), wait_for_ready=True)
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            _sleep_until_next_probe(deadline)


def _sleep_until_next_probe(deadline: float) -> None:
    time.sleep(max(0.0, min(POLL_INTERVAL_S, deadline - time.monotonic())))
