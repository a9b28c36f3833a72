"""``build_server(use_asyncio=True)``: a grpc.aio server behind the synchronous server's verbs. Async handlers
share its event loop (more open streams than the thread pool has threads), plain handlers keep their threads,
health and reflection answer, and ``stop`` ends open streams and the loop."""

from __future__ import annotations

import asyncio
import errno
import socket
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.rpc.server import AsyncioServer, build_server

SERVICE = "test.Streams"


class Streams:
    def __init__(self) -> None:
        self.open_streams = 0
        self.all_open: asyncio.Event | None = None
        self.expected = 0

    async def Wait(self, request: bytes, context):
        """Stays open until ``expected`` streams are open at once, then sends one message each."""
        self.open_streams += 1
        if self.all_open is None:
            self.all_open = asyncio.Event()
        if self.open_streams >= self.expected:
            self.all_open.set()
        await self.all_open.wait()
        yield b"together:" + request

    async def Forever(self, request: bytes, context):
        yield b"first"
        await asyncio.Event().wait()  # until the server stops

    def Echo(self, request: bytes, context) -> bytes:  # a plain handler: runs on the thread pool
        return threading.current_thread().name.encode() + b":" + request


def serve(streams: Streams, max_workers: int = 4):
    def add(server) -> None:
        handlers = {
            "Wait": grpc.unary_stream_rpc_method_handler(streams.Wait),
            "Forever": grpc.unary_stream_rpc_method_handler(streams.Forever),
            "Echo": grpc.unary_unary_rpc_method_handler(streams.Echo),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    return build_server(add, [SERVICE], max_workers=max_workers, use_asyncio=True)


def test_more_open_streams_than_threads_plain_handlers_health_and_stop():
    streams = Streams()
    streams.expected = 12  # three times the pool: a thread-per-stream server would never get them all open
    server, port, health = serve(streams, max_workers=4)
    assert isinstance(server, AsyncioServer)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        check = health_pb2_grpc.HealthStub(channel).Check
        assert check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status == \
            health_pb2.HealthCheckResponse.NOT_SERVING
        health.set_serving(True)
        assert check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING

        wait = channel.unary_stream(f"/{SERVICE}/Wait")
        calls = [wait(str(i).encode(), timeout=20) for i in range(streams.expected)]
        assert [list(call) for call in calls] == [[b"together:" + str(i).encode()] for i in range(streams.expected)]

        assert channel.unary_unary(f"/{SERVICE}/Echo")(b"hi", timeout=5).startswith(b"grpc")  # the pool's thread

        forever = channel.unary_stream(f"/{SERVICE}/Forever")(b"", timeout=30)
        assert next(forever) == b"first"
        assert server.stop(grace=0.2).wait(10)
        with pytest.raises(grpc.RpcError) as failed:
            next(forever)  # an open stream ends (cancelled by the stop), it does not hang
        assert failed.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert server.wait_for_termination(0)
        assert server.stop(grace=None).wait(1)  # a second stop: already done
    finally:
        channel.close()


@pytest.mark.parametrize("use_asyncio", [True, False], ids=["asyncio", "threads"])
def test_a_taken_port_is_refused_with_the_os_reason(use_asyncio):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: ") as refused:
            build_server(lambda s: None, [SERVICE], port=port, use_asyncio=use_asyncio)
    assert refused.value.errno == errno.EADDRINUSE  # `pdserve up` retries a worker on another port by it
