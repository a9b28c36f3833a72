"""The client library's streams: read by the iterating thread itself (no channel thread relaying each message to
it), cancelled from another thread while that thread waits for the next message, errors raised as RpcError."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from common.rpc.server import build_server
from pdserve.client import Client
from pdserve.v1 import generate_pb2, generate_pb2_grpc, types_pb2


class Slow(generate_pb2_grpc.GenerateServiceServicer):
    """Streams one token a message, a message every 20 ms; a prompt token of 0 fails after the first message."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def Generate(self, request, context):
        context.add_callback(self.cancelled.set)
        for i in range(request.sampling.max_tokens):
            if i == 1 and list(request.token_ids.ids[:1]) == [0]:
                context.abort(grpc.StatusCode.UNAVAILABLE, "worker went away")
            yield generate_pb2.GenerateResponse(request_id="r", token_ids=[i + 1], text=f"t{i}")
            time.sleep(0.02)
        yield generate_pb2.GenerateResponse(request_id="r", finish_reason=types_pb2.FINISH_REASON_LENGTH)


@pytest.fixture(scope="module")
def server():
    servicer = Slow()
    server, port, _ = build_server(lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, s),
                                   ["pdserve.v1.GenerateService"])  # fmt: skip
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def test_messages_are_read_by_the_iterating_thread(server):
    address, _ = server
    with Client(address, timeout_s=10) as client:
        before = {t.ident for t in threading.enumerate()}
        pieces = []
        for piece in client.stream([5, 6], max_tokens=5):
            pieces.append(piece)
            started = {t.name for t in threading.enumerate()
                       if t.ident not in before and not t.name.startswith("grpc_")}  # (the server's own pool)
            assert not started, f"threads started for the stream: {started}"
    assert [p.token_ids for p in pieces[:-1]] == [[1], [2], [3], [4], [5]]
    assert pieces[-1].finish_reason == "length"


def test_a_stream_cancelled_from_another_thread_ends_at_once(server):
    address, servicer = server
    servicer.cancelled.clear()
    with Client(address, timeout_s=10) as client:
        call = client.stream_call([5], max_tokens=500)  # 10 s of messages
        first = next(call)
        assert list(first.token_ids) == [1]
        threading.Timer(0.1, call.cancel).start()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            for _ in call:
                pass
        assert caught.value.code() is grpc.StatusCode.CANCELLED
        assert time.monotonic() - t0 < 2
    assert servicer.cancelled.wait(5)


def test_a_failing_stream_raises_its_status(server):
    address, _ = server
    with Client(address, timeout_s=10) as client:
        with pytest.raises(grpc.RpcError) as caught:
            list(client.stream([0], max_tokens=5))
    assert caught.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "worker went away" in caught.value.details()
