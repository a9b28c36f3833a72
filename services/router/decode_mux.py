"""One ``DecodeMany`` stream per decode worker, shared by every request the router decodes there.

A request's Decode call through the mux (:meth:`DecodeMux.decode`) behaves as a ``Decode`` call of its own:
iterate it for :class:`~pdserve.v1.worker_pb2.DecodeResponse` pieces; it raises :class:`grpc.RpcError` (a
:class:`StreamError`) with the status its Decode call would have ended with, and ``cancel()`` stops it. What
changes is the traffic: the worker sends one message a step for all of them, and the router reads one.

- The stream opens with the first request and is reopened by the first request after it ended. When it fails
  (the worker died, a network break), every request on it fails with that status (UNAVAILABLE when the worker
  ended it): :meth:`services.router.decode_stream.DecodeStreamMixin._relay` moves each to another worker.
- Each request keeps its own deadline here too: a worker that stops answering cannot hold one past it.
- A KV hand-off to the worker keeps the stream open (:meth:`DecodeMux.watch`): the channel's keepalive pings then
  notice a worker gone silent while its KV moves by NIXL, when nothing else may be open to it.
- A worker without ``DecodeMany`` (an older version, during a rolling upgrade) answers UNIMPLEMENTED before any
  token: the requests waiting for it then make plain ``Decode`` calls, and so does every later one.
- A request whose client lags gets what queued meanwhile as one piece (tokens, text and logprobs joined).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from common.rpc.convert import extend_decode_piece
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from services.router.errors import worker_status

log = logging.getLogger(__name__)
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_END = object()  # the stream ended: nothing more to write


class StreamError(grpc.RpcError):
    """How a request on the mux ended other than with its last piece: the status its Decode call would have."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Unsupported(Exception):
    """The worker has no DecodeMany: the request falls back to a Decode call."""


class DecodeMux:
    """The router's ``DecodeMany`` stream to one decode worker. Used from one event loop."""

    def __init__(self, stub: worker_pb2_grpc.DecodeServiceStub, address: str) -> None:
        self.stub = stub
        self.address = address
        self.supported = True  # False once the worker answered UNIMPLEMENTED: plain Decode calls from then on
        self._call = None
        self._reader: asyncio.Task | None = None
        self._outgoing: _Outgoing | None = None
        self._waiting: dict[str, asyncio.Queue] = {}  # request id -> its pieces (and errors)
        self._ended: asyncio.Future | None = None  # of the open stream: see watch()

    def decode(self, request: worker_pb2.DecodeRequest, *, timeout: float,
               metadata: Sequence[tuple[str, str]] = ()) -> MuxedDecode | grpc.aio.UnaryStreamCall:
        """A Decode call of ``request`` with ``timeout`` seconds: on the mux, or a plain one if the worker has none."""
        if not self.supported:
            return self.stub.Decode(request, timeout=timeout, metadata=metadata)
        return MuxedDecode(self, request, timeout, metadata)

    # -- the stream -----------------------------------------------------------------------------------------

    def watch(self) -> asyncio.Future | None:
        """Keep the stream open (opening it if it is not) and return a future that completes when it ends: with the
        :class:`StreamError` of a failure (the worker died, or its host went silent: the channel's keepalive pings
        went unanswered), with None when the worker ended it. A KV hand-off watches its decode worker so: while the
        KV moves by NIXL nothing else may be open to that worker, and no ping would notice it gone. None when the
        worker has no DecodeMany. Callers wait on the future; none may cancel it (it is shared)."""
        if not self.supported:
            return None
        self._stream()
        return self._ended

    def _stream(self) -> None:
        if self._call is None:
            self._outgoing = _Outgoing()
            self._ended = asyncio.get_running_loop().create_future()
            self._call = self.stub.DecodeMany(self._outgoing.messages())
            self._reader = asyncio.get_running_loop().create_task(self._read(self._call, self._outgoing, self._ended))

    def _open(self, rid: str, message: worker_pb2.DecodeManyRequest) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._waiting[rid] = queue
        self._stream()
        self._outgoing.put(message)
        return queue

    def _cancel(self, rid: str, queue: asyncio.Queue) -> None:
        if self._waiting.get(rid) is queue:
            del self._waiting[rid]
            if self._outgoing is not None:
                self._outgoing.put(worker_pb2.DecodeManyRequest(cancel=rid))

    async def _read(self, call, outgoing: _Outgoing, ended: asyncio.Future) -> None:
        """Hand each update to its request's queue until the stream ends; then end every request still on it."""
        error: StreamError | _Unsupported
        failure: StreamError | None = None  # what ``ended`` reports: only a failure, not the worker's own end
        received = False
        try:
            await call.initial_metadata()  # the worker's DecodeMany sends them at once; an error ends the call first
            if not call.done():
                outgoing.start()
            async for response in call:
                received = True
                for update in response.updates:
                    queue = self._waiting.get(update.request_id)
                    if queue is None:  # cancelled meanwhile
                        continue
                    piece = update.piece
                    if piece.token_ids or piece.text or piece.finish_reason or not update.status_code:
                        queue.put_nowait(piece)  # (tokens merged ahead of a status come first)
                    if update.status_code:
                        code = _CODES.get(update.status_code, grpc.StatusCode.UNKNOWN)
                        queue.put_nowait(StreamError(code, update.status_details))
                    if update.status_code or piece.finish_reason:
                        del self._waiting[update.request_id]
            error = StreamError(grpc.StatusCode.UNAVAILABLE, f"decode worker {self.address} ended the stream")
        except grpc.RpcError as exc:
            code = exc.code()
            if code is grpc.StatusCode.UNIMPLEMENTED and not received:
                self.supported = False
                log.warning("decode worker %s has no DecodeMany: plain Decode calls to it", self.address)
                error = _Unsupported()
            else:  # a worker that went away mid-stream (its server stopped) failed every request on it
                code = worker_status(exc)
                error = failure = StreamError(code, exc.details() or code.name)
        finally:
            if self._call is call:
                self._call = self._outgoing = None
            outgoing.close()
            if not ended.done():
                ended.set_result(failure)
        waiting, self._waiting = self._waiting, {}
        for queue in waiting.values():
            queue.put_nowait(error)


class _Outgoing:
    """What the router writes on one DecodeMany stream: nothing before the worker's headers (a worker without the
    method then ends the call with UNIMPLEMENTED alone; a write racing that answer made gRPC report INTERNAL),
    nothing after the stream ended."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._started = asyncio.Event()
        self._closed = False

    def put(self, message: worker_pb2.DecodeManyRequest) -> None:
        self._queue.put_nowait(message)

    def start(self) -> None:
        self._started.set()

    def close(self) -> None:
        self._closed = True
        self._started.set()
        self._queue.put_nowait(_END)

    async def messages(self) -> AsyncIterator[worker_pb2.DecodeManyRequest]:
        await self._started.wait()
        while not self._closed:
            message = await self._queue.get()
            if message is _END or self._closed:
                return
            yield message


class MuxedDecode:
    """One request's Decode call on a :class:`DecodeMux`: iterate it once; ``cancel()`` from anywhere. Like a
    Decode call it starts when made (on the event loop), not when first read: the router makes it before the
    first token goes out, so the worker's reservation never waits on the client."""

    def __init__(self, mux: DecodeMux, request, timeout: float, metadata: Sequence[tuple[str, str]]) -> None:
        self._mux = mux
        self._request = request
        self._deadline = time.monotonic() + timeout
        self._metadata = tuple(metadata)
        self._fallback = None  # the plain Decode call, when the worker has no DecodeMany
        self._cancelled = self._finished = False
        self._queue: asyncio.Queue = mux._open(request.request_id, worker_pb2.DecodeManyRequest(
            open=worker_pb2.DecodeOpen(request=request, timeout_s=timeout, trace_context=dict(self._metadata))))
        loop = asyncio.get_running_loop()  # the worker keeps the deadline too; this one holds if it is stuck
        self._expiry = loop.call_at(loop.time() + timeout, self._expire)

    def _expire(self) -> None:
        """The deadline passed: the worker is told to stop, the reader gets DEADLINE_EXCEEDED next."""
        if not self._finished and not self._cancelled:
            self._mux._cancel(self._request.request_id, self._queue)
            self._queue.put_nowait(StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def cancel(self) -> bool:
        if self._fallback is not None:
            return self._fallback.cancel()
        if self._cancelled or self._finished:
            return False
        self._cancelled = True
        self._expiry.cancel()
        self._mux._cancel(self._request.request_id, self._queue)
        return True

    def __aiter__(self):
        return self._pieces()

    async def _pieces(self):
        if self._cancelled:
            raise StreamError(grpc.StatusCode.CANCELLED, "cancelled")
        unsupported = False
        try:
            while True:
                item = await self._next()
                if isinstance(item, _Unsupported):
                    unsupported = True
                    break
                if isinstance(item, BaseException):
                    self._finished = True
                    raise item
                if item.finish_reason:
                    self._finished = True
                yield item
                if self._finished:
                    return
        finally:
            self._expiry.cancel()
            if not self._finished and not unsupported:  # the client left, or this task was cancelled
                self.cancel()
        # here the worker has no DecodeMany (it answered before anything of this request): a Decode call instead
        self._fallback = self._mux.stub.Decode(self._request, timeout=max(0.001, self._deadline - time.monotonic()),
                                               metadata=self._metadata)  # fmt: skip
        async for piece in self._fallback:
            yield piece

    async def _next(self):
        """The next piece, merged with every piece queued behind it (the client lagged), or an error."""
        queue = self._queue
        first = await queue.get()
        if isinstance(first, BaseException) or first.finish_reason or queue.empty():
            return first
        merged = worker_pb2.DecodeResponse()
        merged.MergeFrom(first)
        while not queue.empty():
            item = queue._queue[0]  # noqa: SLF001 - peek: an error ends the merge and is returned next time
            if isinstance(item, BaseException):
                break
            queue.get_nowait()
            extend_decode_piece(merged, item)
            if item.finish_reason:
                break
        return merged
