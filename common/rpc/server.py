"""Builds a pdserve gRPC server: the service's servicers plus grpc.health.v1 and server reflection.

Every service answers ``grpc.health.v1.Health/Check`` (overall status under the service name ``""`` and
under each of its own service names) and server reflection, so ``grpcurl -plaintext ADDR list`` works (with
mutual TLS: ``grpcurl -cacert CA -cert CERT -key KEY ADDR list``).

Plaintext unless given :class:`common.rpc.tls.TlsFiles`: then a server listens only for TLS (requiring a client
certificate signed by the CA when the files name one) and a channel dials with mutual TLS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.rpc.tls import TlsFiles, open_channel, server_credentials

MAX_MESSAGE_BYTES = 64 << 20  # KV chunks are far smaller; prompts of a million tokens fit
# Liveness of a peer with open calls: a channel pings every KEEPALIVE_S while calls are open, and a peer that
# does not answer within KEEPALIVE_TIMEOUT_S (a hung or frozen process, a silent network split) fails every
# call on the channel with UNAVAILABLE, so the router's retry and migration take over instead of a hang.
KEEPALIVE_S = 5.0
KEEPALIVE_TIMEOUT_S = 5.0
_SERVER_KEEPALIVE = [  # accept the clients' pings even on a quiet stream (a long prefill, a queued request)
    ("grpc.http2.min_ping_interval_without_data_ms", int(KEEPALIVE_S * 1000) // 2),
    ("grpc.http2.max_ping_strikes", 0),
]
_CLIENT_KEEPALIVE = [
    ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
    ("grpc.http2.ping_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),  # gRPC >= 1.5x: the unanswered-ping limit
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
]


class HealthState:
    """The health servicer of one server, and the verbs to flip it."""

    def __init__(self, service_names: Sequence[str]) -> None:
        self.servicer = health.HealthServicer()
        self._names = ["", *service_names]
        self.set_serving(False)

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self._names:
            self.servicer.set(name, status)

    def shutdown(self) -> None:
        self.servicer.enter_graceful_shutdown()


def build_server(
    add_servicers: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 32,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    tls: TlsFiles | None = None,
) -> tuple[grpc.Server, int, HealthState]:
    """A started-not-yet server bound to ``host:port`` (0 = any free port); returns (server, port, health).

    ``add_servicers(server)`` registers the service's servicers; ``service_names`` are their full names
    (e.g. ``pdserve.v1.DecodeService``) for health and reflection. Health starts NOT_SERVING: the service
    flips it once its model is loaded and it is registered. ``interceptors`` wrap every method, health and
    reflection included (e.g. :class:`common.security.grpc_auth.AuthInterceptor`, which leaves health open).
    ``tls``: the port speaks only TLS with these files (:func:`common.rpc.tls.server_credentials`: with a CA
    file, a client without a certificate signed by it is refused at the handshake); None: plaintext. Raises
    ValueError naming a bad TLS file.
    """
    credentials = server_credentials(tls) if tls is not None else None  # before anything binds: fail fast
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=list(interceptors),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            *_SERVER_KEEPALIVE,
        ],
    )
    add_servicers(server)
    state = HealthState(service_names)
    health_pb2_grpc.add_HealthServicer_to_server(state.servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    target = f"{host}:{port}"
    bound = server.add_insecure_port(target) if credentials is None else server.add_secure_port(target, credentials)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return server, bound, state


def channel(address: str, tls: TlsFiles | None = None) -> grpc.Channel:
    """A client channel to another pdserve service, with the same message size limits and keepalive pings (a
    peer that stops answering fails the channel's calls with UNAVAILABLE within about 2 × KEEPALIVE_S).

    ``tls``: mutual TLS with these files (:func:`common.rpc.tls.open_channel`); None: plaintext. Raises
    ValueError naming a bad TLS file."""
    return open_channel(
        address,
        tls,
        [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *_CLIENT_KEEPALIVE,
        ],
    )
