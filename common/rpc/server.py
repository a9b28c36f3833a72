"""Builds a pdserve gRPC server: the service's servicers plus grpc.health.v1 and server reflection.

Every service answers ``grpc.health.v1.Health/Check`` (overall status under the service name ``""`` and
under each of its own service names) and server reflection, so ``grpcurl -plaintext ADDR list`` works (with
mutual TLS: ``grpcurl -cacert CA -cert CERT -key KEY ADDR list``).

Plaintext unless given :class:`common.rpc.tls.TlsFiles`: then a server listens only for TLS (requiring a client
certificate signed by the CA when the files name one) and a channel dials with mutual TLS.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.rpc.guard import AsyncInterceptor
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


def hold_port(host: str, port: int) -> socket.socket | None:
    """A socket bound to ``host:port`` (not listening, no SO_REUSEADDR), so that no socket of this process or host
    namespace is given that port as an ephemeral one until it closes; None for port 0 or where it cannot bind
    (:func:`build_server` then says why). A worker holds its gRPC port from its start, while its model loads
    (tensor-parallel ranks connect through ephemeral ports) and while it starts NIXL, whose UCX listeners take
    ephemeral ports: 32768-60999 on Linux, which hold 50051 and every port the OS hands out for port 0. A decode
    worker once failed to start with 'Address already in use' in a namespace of its own, and a prefill worker of
    ``pdserve up`` found its port taken after its model loaded beside a starting tensor-parallel decode worker.
    Close it right before :func:`build_server`."""
    try:
        return _bound_socket(host, port) if port else None
    except OSError:
        return None


def _bound_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``; the OS's OSError (EADDRINUSE, EACCES, EADDRNOTAVAIL, ...) where it cannot."""
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    held = socket.socket(family, kind, proto)
    try:
        held.bind(address)
    except OSError:
        held.close()
        raise
    return held


def listen_error(host: str, port: int) -> OSError:
    """The error for a server that cannot listen on ``host:port``, with the OS's reason and errno where a bind
    of it fails now (gRPC only says that it could not): ``[Errno 98] cannot listen on 127.0.0.1:50051: Address
    already in use``. A caller tells a taken port (``errno.EADDRINUSE``) from a bad address by its errno."""
    try:
        _bound_socket(host, port).close()
    except OSError as exc:
        message = f"cannot listen on {host}:{port}: {exc.strerror or exc}"
        return OSError(exc.errno, message) if exc.errno else OSError(message)
    return OSError(f"cannot listen on {host}:{port}")


def build_server(
    add_servicers: Callable[[grpc.Server], None],
    service_names: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 32,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    tls: TlsFiles | None = None,
    use_asyncio: bool = False,
) -> tuple[grpc.Server | AsyncioServer, int, HealthState]:
    """A started-not-yet server bound to ``host:port`` (0 = any free port); returns (server, port, health).

    ``add_servicers(server)`` registers the service's servicers; ``service_names`` are their full names
    (e.g. ``pdserve.v1.DecodeService``) for health and reflection. Health starts NOT_SERVING: the service
    flips it once its model is loaded and it is registered. ``interceptors`` wrap every method, health and
    reflection included (e.g. :class:`common.security.grpc_auth.AuthInterceptor`, which leaves health open).
    ``tls``: the port speaks only TLS with these files (:func:`common.rpc.tls.server_credentials`: with a CA
    file, a client without a certificate signed by it is refused at the handshake); None: plaintext. Raises
    ValueError naming a bad TLS file.

    ``use_asyncio``: an :class:`AsyncioServer` (grpc.aio on an event loop thread of its own) instead: ``async``
    handlers run on that loop, plain ones on the same thread pool as before. Streams of many small messages cost
    about half the CPU there (no thread hand-off per message). ``interceptors`` are the threaded server's kind,
    driven through :class:`common.rpc.guard.AsyncInterceptor` (they must decide without blocking and guard
    handlers with :func:`common.rpc.guard.guard_handler`, as pdserve's own do).
    """
    credentials = server_credentials(tls) if tls is not None else None  # before anything binds: fail fast
    pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc")
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        *_SERVER_KEEPALIVE,
    ]
    if use_asyncio:
        server = AsyncioServer(pool, options, [AsyncInterceptor(i) for i in interceptors])
    else:
        server = grpc.server(pool, interceptors=list(interceptors), options=options)
    add_servicers(server)
    state = HealthState(service_names)
    health_pb2_grpc.add_HealthServicer_to_server(state.servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    target = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(target) if credentials is None else server.add_secure_port(target, credentials)
    except RuntimeError:  # grpc.aio's refusal of a port it cannot bind
        bound = 0
    if bound == 0:
        if isinstance(server, AsyncioServer):
            server.stop(None).wait()
        raise listen_error(host, port)
    return server, bound, state


class AsyncioServer:
    """A ``grpc.aio`` server behind the synchronous server's verbs (``add_generic_rpc_handlers``,
    ``add_insecure_port``, ``add_secure_port``, ``start``, ``stop`` returning an event, ``wait_for_termination``),
    so a service can serve its token streams from ``async`` handlers without the rest of it changing.

    The server lives on an event loop in a daemon thread of its own; handlers that are not coroutine functions
    or async generators run on ``pool`` (also the loop's default executor, for ``run_in_executor(None, ...)``).
    """

    def __init__(self, pool: futures.ThreadPoolExecutor, options: Sequence[tuple[str, object]],
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(pool)
        self._stopped = threading.Event()  # set once the loop has ended
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="grpc-aio", daemon=True)
        self._thread.start()
        ready.wait()

        async def make() -> grpc.aio.Server:
            return grpc.aio.server(migration_thread_pool=pool, options=list(options),
                                   interceptors=list(interceptors) or None)

        self._server = self._call(make())

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop the server and its async handlers run on (for code that drives them from other threads)."""
        return self._loop

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(ready.set)
        try:
            self._loop.run_forever()
            left = asyncio.all_tasks(self._loop)  # handlers the stop cancelled: let them unwind
            for task in left:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        finally:
            self._loop.close()
            self._stopped.set()

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _on_loop(self, fn: Callable, *args):
        async def run():
            return fn(*args)

        return self._call(run())

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._on_loop(self._server.add_generic_rpc_handlers, handlers)

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:  # generated add_*_to_server
        self._on_loop(self._server.add_registered_method_handlers, service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._on_loop(self._server.add_insecure_port, address)

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return self._on_loop(self._server.add_secure_port, address, credentials)

    def start(self) -> None:
        self._call(self._server.start())

    def stop(self, grace: float | None) -> threading.Event:
        """Refuse new calls, cancel those still open after ``grace`` seconds, then end the loop; the event is
        set once all that is done."""
        if self._stopped.is_set() or not self._thread.is_alive():
            self._stopped.set()
            return self._stopped

        async def stop() -> None:
            try:
                await self._server.stop(grace)
            finally:
                self._loop.call_soon(self._loop.stop)

        asyncio.run_coroutine_threadsafe(stop(), self._loop)
        return self._stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """True once the server stopped (within ``timeout``)."""
        return self._stopped.wait(timeout)


def channel(address: str, tls: TlsFiles | None = None, *, use_asyncio: bool = False) -> grpc.Channel:
    """A client channel to another pdserve service, with the same message size limits and keepalive pings (a
    peer that stops answering fails the channel's calls with UNAVAILABLE within about 2 × KEEPALIVE_S).

    ``tls``: mutual TLS with these files (:func:`common.rpc.tls.open_channel`); None: plaintext. Raises
    ValueError naming a bad TLS file. ``use_asyncio``: a ``grpc.aio`` channel (open it on the loop that uses it)."""
    return open_channel(
        address,
        tls,
        [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *_CLIENT_KEEPALIVE,
        ],
        use_asyncio=use_asyncio,
    )


def stop_on_signals(stop_event: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop_event`` (a drain) instead of killing the process; call it before the server
    serves, and wait on the event with a timeout (a signal the kernel hands to another thread runs its handler
    only once the main thread runs bytecode). Off the main thread (a service run inside tests) it does nothing.

    The handler does not set the event itself. Python runs it on the main thread between two bytecodes, which may
    fall inside ``stop_event.wait()`` while that thread holds the event's lock, and ``set()`` would then wait for
    that lock forever (a ``pdserve up`` hung so at Ctrl-C, once in CI). It writes a byte to a pipe, which takes
    no lock, and a daemon thread that reads the pipe sets the event."""
    if threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def relay() -> None:
        while os.read(read_fd, 1):
            stop_event.set()

    def handler(signum, frame) -> None:
        try:
            os.write(write_fd, b"s")
        except BlockingIOError:  # a full pipe: signals enough are on their way to the relay
            pass

    threading.Thread(target=relay, name="stop-on-signals", daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
