"""DecodeService.DecodeMany: many Decode calls on one stream (the router's, per decode worker), and the router's
side of it (services.router.decode_mux): same tokens as Decode calls, one message for a step's tokens of every
request, each request ending on its own (cancel, deadline, refusal), and a fallback to Decode calls for workers
without it."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import pytest

from pdserve.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.router.decode_mux import DecodeMux, MuxedDecode, StreamError, _Outgoing
from tests.services.inprocess import inprocess_cluster

PROMPTS = [[5, 17, 230, 41, 9, 77], [12, 8, 301, 66], [99, 3, 150, 27, 88]]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with inprocess_cluster(tiny_model_dir("llama"), prefill=[{"worker_id": "prefill-0"}],
                           decode=[{"worker_id": "decode-0"}]) as c:
        yield c


def request(rid: str, prompt: list[int], max_tokens: int, *, prefill_here: bool = True) -> worker_pb2.DecodeRequest:
    sampling = types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                                    prefill_here=prefill_here)  # fmt: skip


def open_(req: worker_pb2.DecodeRequest, timeout_s: float = 0.0) -> worker_pb2.DecodeManyRequest:
    return worker_pb2.DecodeManyRequest(open=worker_pb2.DecodeOpen(request=req, timeout_s=timeout_s))


class Stream:
    """A DecodeMany call fed from a queue; ``close()`` ends the caller's side."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        self._outgoing: queue.Queue = queue.Queue()
        stub = worker_pb2_grpc.DecodeServiceStub(self._channel)
        self.responses = stub.DecodeMany(iter(self._outgoing.get, None), timeout=120)

    def send(self, message: worker_pb2.DecodeManyRequest) -> None:
        self._outgoing.put(message)

    def close(self) -> None:
        self._outgoing.put(None)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        self.responses.cancel()
        self._channel.close()


def collect(stream: Stream, rids: set[str], on_update=None) -> tuple[dict, dict, list[int]]:
    """Read until every request in ``rids`` ended: (tokens by id, status by id, updates per message)."""
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    statuses: dict[str, tuple[int, str]] = {}
    sizes = []
    open_ids = set(rids)
    for response in stream.responses:
        sizes.append(len(response.updates))
        for update in response.updates:
            if on_update is not None:
                on_update(update)
            if update.status_code:
                statuses[update.request_id] = (update.status_code, update.status_details)
                open_ids.discard(update.request_id)
                continue
            tokens.setdefault(update.request_id, []).extend(update.piece.token_ids)
            if update.piece.finish_reason:
                open_ids.discard(update.request_id)
        if not open_ids:
            break
    return tokens, statuses, sizes


def decode_alone(address: str, req: worker_pb2.DecodeRequest) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        return [t for piece in worker_pb2_grpc.DecodeServiceStub(ch).Decode(req, timeout=60) for t in piece.token_ids]


def test_requests_on_one_stream_equal_decode_calls_and_share_messages(cluster):
    address = cluster.workers["decode-0"]
    expected = {f"alone-{i}": decode_alone(address, request(f"alone-{i}", p, 24)) for i, p in enumerate(PROMPTS)}
    with Stream(address) as stream:
        for i, p in enumerate(PROMPTS):
            stream.send(open_(request(f"many-{i}", p, 24)))
        tokens, statuses, sizes = collect(stream, {f"many-{i}" for i in range(len(PROMPTS))})
        stream.close()
        assert list(stream.responses) == []  # the caller closed its side, nothing open: the stream ends
    assert statuses == {}
    assert [tokens[f"many-{i}"] for i in range(len(PROMPTS))] == [expected[f"alone-{i}"] for i in range(len(PROMPTS))]
    assert all(len(t) == 24 for t in tokens.values())
    # the three decode in one batch: their tokens of a step leave in one message
    assert max(sizes) == len(PROMPTS)
    assert len(sizes) < 24 * len(PROMPTS) / 2


def test_each_request_ends_on_its_own(cluster):
    """A refusal, a deadline and a cancel end one request each; the others go on."""
    address = cluster.workers["decode-0"]
    cancelled = threading.Event()
    with Stream(address) as stream:
        stream.send(open_(request("keeps-going", PROMPTS[0], 40)))
        stream.send(open_(request("no-reservation", PROMPTS[1], 4, prefill_here=False)))
        stream.send(open_(request("short-deadline", PROMPTS[2], 100_000), timeout_s=0.3))
        stream.send(open_(request("cancelled", PROMPTS[2], 100_000)))

        def on_update(update):
            if update.request_id == "cancelled" and not cancelled.is_set():
                cancelled.set()
                stream.send(worker_pb2.DecodeManyRequest(cancel="cancelled"))

        rids = {"keeps-going", "no-reservation", "short-deadline"}
        tokens, statuses, _ = collect(stream, rids, on_update)
    assert len(tokens["keeps-going"]) == 40
    assert statuses["no-reservation"][0] == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert "no KV reservation" in statuses["no-reservation"][1]
    assert statuses["short-deadline"][0] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "keeps-going" not in statuses and "cancelled" not in statuses
    assert cancelled.is_set()
    deadline = time.monotonic() + 10  # the cancelled and timed-out requests left the engine
    while time.monotonic() < deadline and _running(cluster) != 0:
        time.sleep(0.05)
    assert _running(cluster) == 0


def test_a_duplicate_open_is_refused(cluster):
    with Stream(cluster.workers["decode-0"]) as stream:
        stream.send(open_(request("twice", PROMPTS[0], 30)))
        stream.send(open_(request("twice", PROMPTS[1], 30)))
        seen = []
        for response in stream.responses:
            seen += response.updates
            if any(u.piece.finish_reason for u in seen):
                break
    refused = [u for u in seen if u.status_code]
    assert [(u.request_id, u.status_code) for u in refused] == [("twice", grpc.StatusCode.ALREADY_EXISTS.value[0])]
    assert sum(len(u.piece.token_ids) for u in seen) == 30


def _running(cluster) -> int:
    import urllib.request

    text = urllib.request.urlopen(f"http://{cluster.metrics['decode-0']}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith("pdserve:num_requests_running"):
            return int(float(line.split()[-1]))
    raise AssertionError("no pdserve:num_requests_running in /metrics")


# -- the router's side ------------------------------------------------------------------------------------


def test_router_mux_equals_decode_calls_and_cancels(cluster):
    address = cluster.workers["decode-0"]
    expected = [decode_alone(address, request(f"ref-{i}", p, 16)) for i, p in enumerate(PROMPTS)]

    async def main():
        async with grpc.aio.insecure_channel(address) as ch:
            mux = DecodeMux(worker_pb2_grpc.DecodeServiceStub(ch), address)

            async def run(i):
                call = mux.decode(request(f"mux-{i}", PROMPTS[i], 16), timeout=60)
                assert isinstance(call, MuxedDecode)
                return [t async for piece in call for t in piece.token_ids]

            got = await asyncio.gather(*(run(i) for i in range(len(PROMPTS))))
            # a client that leaves: cancel() mid-stream stops the request on the worker
            call = mux.decode(request("leaves", PROMPTS[0], 100_000), timeout=60)
            async for piece in call:
                if piece.token_ids:
                    break
            assert call.cancel()
            # a deadline that passes while the worker still decodes
            late = mux.decode(request("late", PROMPTS[1], 100_000), timeout=0.3)
            with pytest.raises(StreamError) as err:
                async for _ in late:
                    pass
            assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            return got

    assert asyncio.run(main()) == expected
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(cluster) != 0:
        time.sleep(0.05)
    assert _running(cluster) == 0


def test_router_mux_starts_a_request_when_made_not_when_read(cluster):
    """As a Decode call does: the router makes the call before the first token goes out to the client, and the
    worker's reservation must not wait for the client to take that token."""
    address = cluster.workers["decode-0"]

    async def main():
        async with grpc.aio.insecure_channel(address) as ch:
            mux = DecodeMux(worker_pb2_grpc.DecodeServiceStub(ch), address)
            call = mux.decode(request("eager", PROMPTS[0], 100_000), timeout=60)
            deadline = time.monotonic() + 10
            running = 0
            while time.monotonic() < deadline and running == 0:
                await asyncio.sleep(0.05)
                running = await asyncio.to_thread(_running, cluster)
            call.cancel()
            return running

    assert asyncio.run(main()) == 1


class _DecodeOnly(worker_pb2_grpc.DecodeServiceServicer):
    """A decode worker of an older version: Decode calls; DecodeMany is not registered (UNIMPLEMENTED)."""

    async def Decode(self, request, context):
        for t in range(request.sampling.max_tokens):
            last = t == request.sampling.max_tokens - 1
            yield worker_pb2.DecodeResponse(token_ids=[100 + t],
                                            finish_reason=types_pb2.FINISH_REASON_LENGTH if last else 0)


class _Breaks(worker_pb2_grpc.DecodeServiceServicer):
    """A worker whose DecodeMany fails after the first step (as a crash would end it)."""

    async def DecodeMany(self, request_iterator, context):
        await context.send_initial_metadata(())  # as pdserve's workers do: the router writes after them
        opened = []
        async for message in request_iterator:
            opened.append(message.open.request.request_id)
            if len(opened) == 2:
                break
        yield worker_pb2.DecodeManyResponse(updates=[
            worker_pb2.DecodeUpdate(request_id=rid, piece=worker_pb2.DecodeResponse(token_ids=[7])) for rid in opened])
        await asyncio.sleep(0.1)
        await context.abort(grpc.StatusCode.INTERNAL, "worker broke")


class _Stuck(worker_pb2_grpc.DecodeServiceServicer):
    """A worker that takes requests and never answers them (it hangs); it records what the router sent."""

    def __init__(self):
        self.received = []

    async def DecodeMany(self, request_iterator, context):
        await context.send_initial_metadata(())
        async for message in request_iterator:
            self.received.append(message.WhichOneof("kind"))
        yield worker_pb2.DecodeManyResponse()


def test_router_mux_ends_a_request_at_its_deadline_when_the_worker_hangs():
    stuck = _Stuck()

    async def main():
        server, address = await _serve(stuck)
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                mux = DecodeMux(worker_pb2_grpc.DecodeServiceStub(ch), address)
                t0 = time.monotonic()
                with pytest.raises(StreamError) as err:
                    async for _ in mux.decode(request("hung", [1], 5), timeout=0.3):
                        pass
                took = time.monotonic() - t0
                await asyncio.sleep(0.1)  # the cancel reaches the worker
                return err.value.code(), took
        finally:
            await server.stop(None)

    code, took = asyncio.run(main())
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED and 0.25 <= took < 2
    assert stuck.received == ["open", "cancel"]


async def _serve(servicer):
    server = grpc.aio.server()
    if isinstance(servicer, _DecodeOnly):
        handler = grpc.unary_stream_rpc_method_handler(servicer.Decode, worker_pb2.DecodeRequest.FromString,
                                                       worker_pb2.DecodeResponse.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("pdserve.v1.DecodeService",
                                                                              {"Decode": handler}),))
    else:
        worker_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_router_mux_falls_back_to_decode_calls_on_an_older_worker():
    async def main():
        server, address = await _serve(_DecodeOnly())
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                mux = DecodeMux(worker_pb2_grpc.DecodeServiceStub(ch), address)
                async def tokens(call):
                    return [t async for p in call for t in p.token_ids]

                calls = [mux.decode(request(f"r{i}", [1, 2], 3 + i), timeout=10) for i in range(2)]
                got = await asyncio.gather(*(tokens(c) for c in calls))
                assert not mux.supported
                later = mux.decode(request("later", [1], 2), timeout=10)  # straight to a Decode call
                assert not isinstance(later, MuxedDecode)
                return got, await tokens(later)
        finally:
            await server.stop(None)

    assert asyncio.run(main()) == ([[100, 101, 102], [100, 101, 102, 103]], [100, 101])


def test_router_mux_fails_every_request_when_the_stream_breaks_then_reopens():
    async def main():
        server, address = await _serve(_Breaks())
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                mux = DecodeMux(worker_pb2_grpc.DecodeServiceStub(ch), address)

                async def run(rid):
                    got = []
                    try:
                        async for piece in mux.decode(request(rid, [1], 5), timeout=10):
                            got += piece.token_ids
                    except grpc.RpcError as exc:
                        return got, exc.code(), exc.details()
                    return got, None, ""

                first = await asyncio.gather(run("a"), run("b"))
                again = await asyncio.gather(run("c"), run("d"))  # a new stream for the next requests
                return first, again
        finally:
            await server.stop(None)

    first, again = asyncio.run(main())
    assert first == [([7], grpc.StatusCode.INTERNAL, "worker broke")] * 2
    assert again == first


class _Ends(worker_pb2_grpc.DecodeServiceServicer):
    """A worker whose DecodeMany breaks (``abort`` set: after ``after_s``, as a crash would end it) or ends on its
    own (a drained worker) after ``after_s``, with nothing opened on it."""

    def __init__(self, after_s: float, abort: bool) -> None:
        self.after_s, self.abort = after_s, abort

    async def DecodeMany(self, request_iterator, context):
        await context.send_initial_metadata(())
        await asyncio.sleep(self.after_s)
        if self.abort:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker gone")
        return
        yield  # (a generator: a stream of responses)


@pytest.mark.parametrize("abort", [True, False], ids=["breaks", "ends"])
def test_router_mux_watch_opens_the_stream_and_reports_its_failure_not_its_end(abort):
    """A KV hand-off watches its decode worker through the mux: the stream opens with no request on it, and the
    future completes with the failure (the hand-off is cancelled) or with None when the worker ended the stream."""

    async def main():
        server, address = await _serve(_Ends(0.3, abort))
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                mux = DecodeMux(worker_pb2_grpc.DecodeServiceStub(ch), address)
                ended = mux.watch()
                assert mux.watch() is ended and not ended.done()  # one stream, one future for every watcher
                t0 = time.monotonic()
                result = await asyncio.wait_for(ended, 5)
                return result, time.monotonic() - t0
        finally:
            await server.stop(None)

    result, took = asyncio.run(main())
    assert 0.2 <= took < 3
    if abort:
        assert isinstance(result, StreamError) and result.code() is grpc.StatusCode.UNAVAILABLE
        assert result.details() == "worker gone"
    else:
        assert result is None


def test_router_mux_watch_on_an_older_worker_is_no_watch():
    async def main():
        server, address = await _serve(_DecodeOnly())
        try:
            async with grpc.aio.insecure_channel(address) as ch:
                mux = DecodeMux(worker_pb2_grpc.DecodeServiceStub(ch), address)
                first = await asyncio.wait_for(mux.watch(), 5)  # UNIMPLEMENTED: no failure of the worker's
                return first, mux.supported, mux.watch()
        finally:
            await server.stop(None)

    assert asyncio.run(main()) == (None, False, None)


def test_lagging_pieces_merge_into_one():
    """What queued while the client lagged leaves as one piece; an error queued behind it comes next."""

    class _NoStream(DecodeMux):  # the request's queue without a worker behind it
        def _open(self, rid, message):
            return asyncio.Queue()

    async def main():
        call = MuxedDecode(_NoStream(stub=None, address="nowhere"), request("lag", [1], 5), timeout=5, metadata=())
        q = call._queue
        for t in (1, 2, 3):
            q.put_nowait(worker_pb2.DecodeResponse(token_ids=[t], text=f"<{t}>"))
        q.put_nowait(StreamError(grpc.StatusCode.UNAVAILABLE, "gone"))
        merged = await call._next()
        error = await call._next()
        return merged, error

    merged, error = asyncio.run(main())
    assert list(merged.token_ids) == [1, 2, 3] and merged.text == "<1><2><3>"
    assert isinstance(error, StreamError) and error.code() is grpc.StatusCode.UNAVAILABLE


def test_a_lagging_callers_updates_merge_per_request_and_keep_a_status_after_the_tokens():
    from services.decode.servicer import _merge_updates, _status_update

    def piece(rid, tokens, finish=0):
        return worker_pb2.DecodeUpdate(request_id=rid, piece=worker_pb2.DecodeResponse(
            token_ids=tokens, text="".join(f"<{t}>" for t in tokens), finish_reason=finish))

    updates = [piece("a", [1]), piece("b", [10]), piece("a", [2]), piece("b", [11], types_pb2.FINISH_REASON_LENGTH),
               piece("a", [3]), _status_update("a", grpc.StatusCode.UNAVAILABLE, "engine stopped")]
    merged = _merge_updates(updates)
    assert [(u.request_id, list(u.piece.token_ids), u.piece.text, u.piece.finish_reason, u.status_code)
            for u in merged] == [("a", [1, 2, 3], "<1><2><3>", 0, grpc.StatusCode.UNAVAILABLE.value[0]),
                                 ("b", [10, 11], "<10><11>", types_pb2.FINISH_REASON_LENGTH, 0)]  # fmt: skip
    assert _merge_updates(updates[:2]) == updates[:2]

    class _OneMessage:  # the router reads the merged "a": its tokens, then its status
        def __init__(self):
            self.sent = False

        async def initial_metadata(self):
            return ()

        def done(self):
            return self.sent

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.sent:
                raise StopAsyncIteration
            self.sent = True
            return worker_pb2.DecodeManyResponse(updates=merged[:1])

    async def main():
        mux = DecodeMux(stub=None, address="nowhere")
        queue_ = asyncio.Queue()
        mux._waiting["a"] = queue_
        await mux._read(_OneMessage(), _Outgoing(), asyncio.get_running_loop().create_future())
        return [queue_.get_nowait() for _ in range(queue_.qsize())]

    first, error = asyncio.run(main())
    assert list(first.token_ids) == [1, 2, 3]
    assert isinstance(error, StreamError) and error.details() == "engine stopped"
