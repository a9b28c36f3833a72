"""Builds a pdserve gRPC server: the service's servicers plus grpc.health.v1 and server reflection.

Every service answers ``grpc.health.v1.Health/Check`` (overall status under the service name ``""`` and
under each of its own service names) and server reflection, so ``grpcurl -plaintext ADDR list`` works.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 64 << 20  # KV chunks are far smaller; prompts of a million tokens fit


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
) -> tuple[grpc.Server, int, HealthState]:
    """A started-not-yet server bound to ``host:port`` (0 = any free port); returns (server, port, health).

    ``add_servicers(server)`` registers the service's servicers; ``service_names`` are their full names
    (e.g. ``pdserve.v1.DecodeService``) for health and reflection. Health starts NOT_SERVING: the service
    flips it once its model is loaded and it is registered.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    add_servicers(server)
    state = HealthState(service_names)
    health_pb2_grpc.add_HealthServicer_to_server(state.servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    return server, bound, state


def channel(address: str) -> grpc.Channel:
    """A client channel to another pdserve service, with the same message size limits."""
    return grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ],
    )
