"""``pdserve.v1.DecodeService``: the decode side of the disaggregated hand-off.

Life cycle of a request on a decode worker:

1. ``ReserveKv`` (router): blocks for the prompt's KV are reserved under a lease, after the router's view of
   the model was checked against this worker's identity.
2. ``PushKv`` (prefill worker): chunks arrive in any order; each is verified (header and payload checksums,
   block ranges) and written straight into the reserved blocks on the gRPC thread, under the reservation's
   lock. A bad chunk fails the stream with DATA_LOSS naming it, and the reservation is released. Chunks carry
   every KV head (the engine's ``handoff_spec``); on a tensor-parallel engine (``--tensor-parallel-size`` > 1)
   each is written by ``engine.write_kv`` on the engine thread instead, which sends every rank its heads.
3. ``Decode`` (router): once every layer arrived, the request joins the continuous batch; its tokens after
   the ones prefill produced stream back until it finishes. A client that goes away aborts it. With
   ``prefill_here`` (conditional disaggregation, sessions) there is no reservation: the request is
   prefilled here, reusing what this worker's prefix cache holds, and every token streams back.
4. ``ReleaseKv`` (router), the lease's end, or the end of decoding free the blocks. Never a leak, never a hang.
   Blocks a NIXL block sender claimed (``--kv-nixl``, :mod:`common.kv_transfer.nixl_blocks`) wait until no write
   of it can land in them any more: its quiet, or the end of its grant.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent import futures
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
import torch

from common.engine.block_pool import NoFreeBlocksError
from common.engine.engine_loop import EngineLoop, RequestStream, StreamClosed
from common.engine.identity import ModelIdentity
from common.engine.omp_teams import run_serially
from common.kv_transfer.connector import KVReceiver, TransferState
from common.kv_transfer.grpc_transport import chunk_of_push_kv_request, size_of_probe_link_request
from common.kv_transfer.nixl import NixlKVReceiver
from common.kv_transfer.wire import TransferAssembler, WireFormatError, decode_header, header_size_bytes
from common.metrics.worker import WorkerMetrics
from common.obs import Tracing, call_scope
from common.rpc import convert
from pdserve.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = "pdserve.v1.DecodeService"


PUSH_QUEUE_CHUNKS = 8  # chunks received ahead of the writer (8 x 4 MiB)
ADMIT_WINDOW_S = 10.0  # how long a reservation whose KV is complete waits for its Decode call
MANY_IDLE_POLL_S = 0.25  # how often an idle DecodeMany stream looks whether the worker drains


class _Refused(Exception):
    """A Decode call refused before its stream opened (raised off the event loop, aborted on it)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message

    @classmethod
    def abort(cls, code: grpc.StatusCode, message: str) -> None:
        raise cls(code, message)


class _StreamAbort(Exception):
    """A request of a DecodeMany stream ended with a status (what ``context.abort`` is for a Decode call)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _StreamContext:
    """The context a request of a DecodeMany stream runs ``_decode`` with: its trace context as the call's
    metadata, and ``abort`` ending that request alone."""

    def __init__(self, trace_context) -> None:
        self._metadata = tuple(trace_context.items())

    def invocation_metadata(self):
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _StreamAbort(code, details)


def _merge_updates(updates: list[worker_pb2.DecodeUpdate]) -> list[worker_pb2.DecodeUpdate]:
    """One update per request: the pieces a request queued while the caller lagged, joined (tokens, text and
    logprobs; the last one's finish_reason), its status after them. Requests keep their first update's order."""
    if len({u.request_id for u in updates}) == len(updates):
        return updates
    merged: dict[str, worker_pb2.DecodeUpdate] = {}
    for update in updates:
        into = merged.get(update.request_id)
        if into is None:
            merged[update.request_id] = update
        elif update.status_code:
            into.status_code, into.status_details = update.status_code, update.status_details
        else:
            convert.extend_decode_piece(into.piece, update.piece)
    return list(merged.values())


def _status_update(rid: str, code: grpc.StatusCode, details: str) -> worker_pb2.DecodeUpdate:
    return worker_pb2.DecodeUpdate(request_id=rid, status_code=code.value[0], status_details=details)


@dataclass
class _PushOutcome:
    num_chunks: int = 0
    num_bytes: int = 0
    touched: set[str] = field(default_factory=set)
    error: tuple[grpc.StatusCode, str] | None = None


@dataclass(eq=False)
class _Reservation:
    request_id: str
    block_ids: list[int]
    assembler: TransferAssembler
    expires_at_s: float
    lock: threading.Lock = field(default_factory=threading.Lock)
    released: bool = False


class DecodeServicer(worker_pb2_grpc.DecodeServiceServicer):
    def __init__(
        self,
        loop: EngineLoop,
        identity: ModelIdentity,
        *,
        generation_config,
        default_max_tokens: int,
        max_lease_s: float = 60.0,
        stream_timeout_s: float = 600.0,
        stream_interval: int = 1,
        shm_receiver: KVReceiver | None = None,
        nixl_receiver: NixlKVReceiver | None = None,
        metrics: WorkerMetrics | None = None,
        tracing: Tracing | None = None,
        max_pending_requests: int = 256,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        """``shm_receiver``: a same-host shared-memory KV endpoint offered to prefill workers besides PushKv;
        ``nixl_receiver``: a NIXL endpoint offered to prefill workers on any host (its agent's metadata).
        ``draining``: True once the worker is stopping; new requests are then refused (reserved ones finish)."""
        self.loop = loop
        self.identity = identity
        self.generation_config = generation_config
        self.default_max_tokens = default_max_tokens
        self.max_lease_s = max_lease_s
        self.stream_timeout_s = stream_timeout_s
        self.stream_interval = stream_interval
        self._reservations: dict[str, _Reservation] = {}
        self._held: dict[str, bool] = {}  # keys of released reservations a NIXL block sender may still write
        self._lock = threading.Lock()  # guards the dict, not the reservations
        self.shm_receiver = shm_receiver
        self.nixl_receiver = nixl_receiver
        self._receivers: list[KVReceiver] = [r for r in (shm_receiver, nixl_receiver) if r is not None]
        self.metrics = metrics
        self.tracing = tracing or Tracing("pdserve-decode", environ={})
        self.max_pending_requests = max_pending_requests
        self.draining = draining
        self.host = socket.gethostname()
        # Decode calls open their streams here: admission waits for the engine thread, which must not hold up
        # the event loop that serves every stream's tokens. As many threads as requests the worker may hold, so
        # a burst of Decode calls is admitted together between two steps, not a few per step.
        self._opener_pool = futures.ThreadPoolExecutor(max_workers=max(8, max_pending_requests),
                                                       thread_name_prefix="decode-open")

    # -- ReserveKv ----------------------------------------------------------------------------------------

    def ReserveKv(self, request, context):
        with call_scope(self.tracing, "decode.ReserveKv", request.request_id, context):
            return self._reserve_kv(request, context)

    def _reserve_kv(self, request, context):
        rid = request.request_id
        if request.HasField("identity"):
            problems = self.identity.mismatches(convert.identity_from_proto(request.identity))
            if problems:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"model mismatch: {'; '.join(problems)}")
        if not rid or request.num_tokens < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ReserveKv needs a request_id and num_tokens >= 1")
        self._check_room(context.abort)
        lease_s = min(request.lease_seconds or self.max_lease_s, self.max_lease_s)
        try:
            # The engine's own lease is a backstop only: this servicer releases first (under the lock), so
            # blocks never return to the pool while a chunk is being written into them.
            blocks = self.loop.call(lambda e: e.reserve_kv(rid, request.num_tokens, lease_s=lease_s + 30.0))
        except NoFreeBlocksError as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        engine = self.loop.engine
        reservation = _Reservation(rid, blocks, None, time.monotonic() + lease_s)  # type: ignore[arg-type]
        spec = engine.handoff_spec  # the wire carries every KV head, whatever either side's tensor parallelism
        reservation.assembler = TransferAssembler(rid, spec.num_layers, len(blocks), spec, self._writer(reservation))
        with self._lock:
            self._reservations[rid] = reservation
        response = worker_pb2.ReserveKvResponse(
            num_blocks=len(blocks), identity=convert.identity_to_proto(self.identity), host=self.host
        )
        for receiver in self._receivers:  # the same blocks, by whichever transport the prefill worker picks
            receiver.expect(rid, spec.num_layers, len(blocks), spec, self._writer(reservation), lease_s)
        if self.shm_receiver is not None:
            response.kv_shm_address = self.shm_receiver.address
        if self.nixl_receiver is not None:
            response.kv_nixl_metadata = self.nixl_receiver.metadata
            if self.nixl_receiver.offer_blocks(rid, blocks):  # a NIXL block sender may write them directly
                response.kv_block_ids.extend(blocks)
        return response

    def _check_room(self, abort: Callable[[grpc.StatusCode, str], None]) -> None:
        """A bounded queue: RESOURCE_EXHAUSTED (the router tries another worker) past --max-pending-requests,
        or at once when the worker is draining. ``abort(code, message)`` raises (a context's, or _Refused's)."""
        if self.draining():
            abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "decode worker draining: takes no new requests")
        stats = self.loop.stats
        pending = len(self._reservations) + stats.num_requests_running + stats.num_requests_waiting
        if pending >= self.max_pending_requests:
            abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                  f"decode worker full: {pending} requests pending (--max-pending-requests)")

    def _kv_complete(self, reservation: _Reservation) -> bool:
        if reservation.assembler.complete:
            return True
        return any(r.poll(reservation.request_id) is TransferState.DONE for r in self._receivers)

    def _writer(self, reservation: _Reservation):
        """The write function of a reservation's transfer (either transport): checked chunks land here."""
        if self.loop.engine.tensor_parallel is not None:
            return self._engine_thread_writer(reservation)
        kv_cache = self.loop.engine.kv_cache
        metrics = self.metrics
        header_bytes = header_size_bytes(reservation.request_id)  # each write() is one chunk: header + k + v

        def write(layer: int, first_block: int, k, v) -> None:
            with reservation.lock:
                if reservation.released:
                    raise WireFormatError(f"request {reservation.request_id}: reservation already released")
                kv_cache.write_blocks(layer, reservation.block_ids[first_block : first_block + k.shape[0]], k, v)
            if metrics is not None:
                metrics.count_kv_received(header_bytes + k.nbytes + v.nbytes)

        return write

    def _engine_thread_writer(self, reservation: _Reservation):
        """Tensor parallelism: a chunk's all-head K/V goes through ``engine.write_kv``, which sends every rank its
        heads over the step channel, so it runs on the engine thread between steps (``loop.call``: the transport
        thread waits, and the chunk's buffer stays valid until the write is done).

        The release check runs on the engine thread as well, not under the reservation's lock: admission and
        the engine-side release run there too, so a write either lands before them or sees ``released`` (a
        transport thread holding the lock while it waits for the engine thread could deadlock with admit)."""
        rid = reservation.request_id
        metrics = self.metrics
        header_bytes = header_size_bytes(rid)

        def write_on_engine(engine, layer: int, first_block: int, k, v) -> None:
            if reservation.released:
                raise WireFormatError(f"request {rid}: reservation already released")
            engine.write_kv(rid, layer, first_block, k, v)

        def write(layer: int, first_block: int, k, v) -> None:
            try:
                self.loop.call(lambda e: write_on_engine(e, layer, first_block, k, v))
            except StreamClosed as exc:  # the worker is stopping: the chunk fails like one for a released reservation
                raise WireFormatError(f"request {rid}: the engine loop stopped") from exc
            if metrics is not None:
                metrics.count_kv_received(header_bytes + k.nbytes + v.nbytes)

        return write

    # -- PushKv -------------------------------------------------------------------------------------------

    def PushKv(self, request_iterator, context):
        """Chunks are checked and written on a helper thread while this one already receives the next: gRPC
        reads a stream's next message only when asked, so writing inline would stall the transfer."""
        work: queue.Queue = queue.Queue(maxsize=PUSH_QUEUE_CHUNKS)
        outcome = _PushOutcome()
        writer = threading.Thread(target=self._apply_chunks, args=(work, outcome), name="kv-push", daemon=True)
        writer.start()
        try:
            for chunk in request_iterator:  # chunk bytes (see add_to_server: no protobuf copy)
                if outcome.error is not None:
                    break
                work.put(chunk)
        finally:
            work.put(None)
            writer.join()
        if outcome.error is not None:
            code, message = outcome.error
            context.abort(code, message)
        complete = all(
            (r := self._reservations.get(rid)) is not None and r.assembler.complete for rid in outcome.touched
        )
        return worker_pb2.PushKvResponse(num_chunks=outcome.num_chunks, num_bytes=outcome.num_bytes,
                                         complete=complete)

    def _apply_chunks(self, work: queue.Queue, outcome: _PushOutcome) -> None:
        """Check and write queued chunks until None; the first failure is recorded and the rest drained."""
        run_serially()  # writes KV beside the engine's step: no OpenMP team of its own
        while (chunk := work.get()) is not None:
            if outcome.error is None:
                outcome.error = self._apply_chunk(chunk, outcome)

    def _apply_chunk(self, chunk, outcome: _PushOutcome) -> tuple[grpc.StatusCode, str] | None:
        try:
            header = decode_header(chunk)
        except WireFormatError as exc:
            return grpc.StatusCode.DATA_LOSS, f"unreadable KV chunk: {exc}"
        rid = header.request_id
        reservation = self._reservations.get(rid)
        if reservation is None or reservation.released:
            why = f"no KV reservation for request {rid} (expired, released or never made)"
            return grpc.StatusCode.FAILED_PRECONDITION, why
        try:
            reservation.assembler.feed(chunk)
        except ValueError as exc:  # WireFormatError, ChecksumError, ChunkRejectedError
            self.release(rid)
            return grpc.StatusCode.DATA_LOSS, f"bad KV chunk for request {rid}: {exc}"
        if reservation.assembler.complete:  # Decode follows at once; if it never comes (the router died), the
            # blocks go back after the admission window instead of the whole lease
            reservation.expires_at_s = min(reservation.expires_at_s, time.monotonic() + ADMIT_WINDOW_S)
        outcome.num_chunks += 1
        outcome.num_bytes += len(chunk)
        outcome.touched.add(rid)
        return None

    # -- Decode -------------------------------------------------------------------------------------------

    async def Decode(self, request, context):
        """Served from the worker's asyncio server (``build_server(use_asyncio=True)``): all streams share one
        event loop thread, so a step's tokens reach gRPC without a thread hand-off per token."""
        with call_scope(self.tracing, "decode.Decode", request.request_id, context):
            async for message in self._decode(request, context):
                yield message

    async def _decode(self, request, context):
        rid = request.request_id
        opener = self._prefill_here if request.prefill_here else self._admit_reserved
        opening = self._opener_pool.submit(opener, request)  # it waits for the engine thread: off the event loop
        try:
            stream = await asyncio.wrap_future(opening)
        except _Refused as refused:
            await context.abort(refused.code, refused.message)
        except asyncio.CancelledError:  # the client left while the request was being admitted: undo the admission
            opening.add_done_callback(lambda f: f.cancelled() or f.exception() or self._abort_soon(rid))
            raise
        sent = not request.prefill_here  # an imported request's first token reached the client from prefill
        finished = False
        try:
            while True:
                # several tokens if the client lags; with a stream interval, up to that many after the first
                out = await stream.get_pending_async(timeout_s=self.stream_timeout_s,
                                                     min_tokens=self.stream_interval if sent else 1)  # fmt: skip
                sent = sent or bool(out.new_token_ids)
                yield worker_pb2.DecodeResponse(
                    token_ids=out.new_token_ids,
                    text=out.new_text,
                    logprobs=convert.logprobs_to_proto(out.new_logprobs),
                    finish_reason=convert.finish_reason_to_proto(out.finish_reason if out.finished else None),
                )
                if out.finished:
                    finished = True
                    return
        except StreamClosed as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except queue.Empty:  # the engine produced nothing for stream_timeout_s
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {rid} produced no token in time")
        finally:  # cancelled (the client left), failed or timed out: the engine stops generating for nobody
            if not finished:
                self._abort_soon(rid)

    async def DecodeMany(self, request_iterator, context):
        """Decode calls multiplexed on one stream (a router's, to this worker). Each opened request runs as its
        own Decode call would, on a task of this event loop, and puts its pieces in one outbox; each message takes
        the whole outbox, so one step's tokens of every request leave together: one message and one write a step
        instead of one per request and token. When the caller lags, the pieces a request queued meanwhile leave
        merged into one (:func:`_merge_updates`), as a Decode call's would."""
        opened: dict[str, asyncio.Task] = {}  # request id -> its task
        outbox: list[worker_pb2.DecodeUpdate] = []
        ready = asyncio.Event()
        reading = True

        def put(update: worker_pb2.DecodeUpdate) -> None:
            outbox.append(update)
            ready.set()

        async def run(rid: str, open_: worker_pb2.DecodeOpen) -> None:
            ctx = _StreamContext(open_.trace_context)
            try:
                async with asyncio.timeout(open_.timeout_s if open_.timeout_s > 0 else None):
                    with call_scope(self.tracing, "decode.Decode", rid, ctx):
                        async with aclosing(self._decode(open_.request, ctx)) as pieces:
                            async for piece in pieces:
                                put(worker_pb2.DecodeUpdate(request_id=rid, piece=piece))
            except _StreamAbort as exc:
                put(_status_update(rid, exc.code, exc.details))
            except TimeoutError:
                put(_status_update(rid, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            except Exception as exc:  # noqa: BLE001 - one request's failure must not end the others
                log.exception("decode of %s failed", rid)
                put(_status_update(rid, grpc.StatusCode.INTERNAL, f"decode failed: {exc}"))
            finally:
                if opened.get(rid) is asyncio.current_task():
                    del opened[rid]
                ready.set()

        async def read() -> None:
            nonlocal reading
            try:
                async for message in request_iterator:
                    if message.HasField("open"):
                        rid = message.open.request.request_id
                        if rid in opened:
                            put(_status_update(rid, grpc.StatusCode.ALREADY_EXISTS,
                                               f"request {rid} is already open on this stream"))
                            continue
                        opened[rid] = asyncio.create_task(run(rid, message.open))
                    elif message.cancel:
                        task = opened.pop(message.cancel, None)
                        if task is not None:
                            task.cancel()
            except grpc.RpcError as exc:  # the caller's side broke: the call itself ends with it
                log.debug("DecodeMany requests ended: %s", exc)
            finally:
                reading = False
                ready.set()

        await context.send_initial_metadata(())  # the caller writes once it knows this worker has the method
        reader = asyncio.create_task(read())
        log.info("DecodeMany stream from %s opened", context.peer())
        try:
            while True:
                try:  # a draining worker's idle stream must notice that it may end
                    async with asyncio.timeout(MANY_IDLE_POLL_S):
                        await ready.wait()
                except TimeoutError:
                    pass
                ready.clear()
                if outbox:
                    updates = _merge_updates(outbox[:])
                    outbox.clear()
                    yield worker_pb2.DecodeManyResponse(updates=updates)
                if not opened and not outbox and (not reading or (self.draining() and not self._reservations)):
                    return  # (a draining worker keeps the stream while a reservation may still open on it)
        finally:
            reader.cancel()
            for task in list(opened.values()):
                task.cancel()

    def _abort_soon(self, rid: str) -> None:
        """Abort a request on the engine thread without waiting (a no-op once it finished)."""
        self.loop.submit(lambda e: e.abort(rid))

    def _prefill_here(self, request) -> RequestStream:
        """Conditional disaggregation: the whole request runs here (the prefix cache may hold part of it)."""
        self._check_room(_Refused.abort)
        try:
            sampling = convert.sampling_from_proto(request.sampling, self.generation_config, self.default_max_tokens)
            return self.loop.add_request(list(request.prompt_token_ids), sampling, request_id=request.request_id)
        except ValueError as exc:
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc

    def _admit_reserved(self, request) -> RequestStream:
        rid = request.request_id
        with self._lock:
            reservation = self._reservations.get(rid)
        if reservation is None or reservation.released:
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, f"no KV reservation for request {rid}")
        if not self._kv_complete(reservation):
            missing = reservation.assembler.describe_progress()
            self.release(rid)
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, f"KV of request {rid} is incomplete: {missing}")
        try:
            sampling = convert.sampling_from_proto(request.sampling, self.generation_config, self.default_max_tokens)
        except ValueError as exc:
            self.release(rid)
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        generator_state = None
        if request.generator_state:
            generator_state = torch.frombuffer(bytearray(request.generator_state), dtype=torch.uint8)

        def admit(engine):
            with reservation.lock:  # from here on the blocks belong to the request, not the reservation
                reservation.released = True
            with self._lock:
                self._reservations.pop(rid, None)
            for receiver in self._receivers:
                receiver.abort(rid)  # forget the finished transfer
            return engine.admit_reserved(
                rid, list(request.prompt_token_ids), list(request.output_token_ids), sampling, generator_state,
                report_imported=False,
            )

        try:
            return self.loop.open_stream(admit)
        except ValueError as exc:
            self.release(rid)
            raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        except StreamClosed as exc:
            raise _Refused(grpc.StatusCode.UNAVAILABLE, str(exc)) from exc

    # -- ProbeLink ------------------------------------------------------------------------------------------

    def ProbeLink(self, request_iterator, context):
        """Count a stream's bytes and drop them (see add_to_server: each item is a message's data size)."""
        num_messages = num_bytes = 0
        for size in request_iterator:
            num_messages += 1
            num_bytes += size
        return worker_pb2.ProbeLinkResponse(num_messages=num_messages, num_bytes=num_bytes)

    # -- ReleaseKv, leases --------------------------------------------------------------------------------

    def ReleaseKv(self, request, context):
        return worker_pb2.ReleaseKvResponse(released=self.release(request.request_id))

    def release(self, request_id: str) -> bool:
        """Release a reservation or abort a decoding request; True if there was one. Idempotent. A reservation
        a NIXL block sender may still write is held, and its blocks freed by :meth:`expire_leases` later."""
        with self._lock:
            reservation = self._reservations.pop(request_id, None)
        for receiver in self._receivers:
            receiver.abort(request_id)  # returns once its write() will not be called again
        if reservation is not None:
            with reservation.lock:  # waits for a chunk being written into these blocks
                reservation.released = True
        held = self.nixl_receiver.hold(request_id) if self.nixl_receiver is not None else None
        if held is not None:  # a NIXL block sender's writes may still land in the blocks: freed once it is quiet
            with self._lock:  # (under a key of their own: a retry of the request may reserve blocks again)
                self._held[held] = True
            try:
                self.loop.call(lambda e: e.hold_kv(request_id, held), timeout_s=10.0)
            except StreamClosed:
                pass
            return True
        try:
            return self.loop.call(lambda e: e.abort(request_id), timeout_s=10.0) or reservation is not None
        except StreamClosed:
            return reservation is not None

    def expire_leases(self) -> list[str]:
        """Release every reservation whose lease ended, and free the blocks of released ones that a NIXL block
        sender may no longer write (a worker thread calls this periodically)."""
        self._free_held()
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, r in self._reservations.items() if r.expires_at_s <= now]
        for rid in expired:
            log.warning("KV reservation of request %s expired before Decode; released", rid)
            self.release(rid)
        return expired

    def _free_held(self) -> None:
        with self._lock:
            held = list(self._held)
        for key in held:
            if self.nixl_receiver.writing(key):
                continue
            with self._lock:
                del self._held[key]
            try:
                self.loop.call(lambda e, key=key: e.release_kv(key), timeout_s=10.0)
            except StreamClosed:
                return

    @property
    def num_held(self) -> int:
        """Released reservations whose blocks wait until a NIXL block sender can no longer write them."""
        return len(self._held)

    @property
    def num_reservations(self) -> int:
        return len(self._reservations)

    def close(self) -> None:
        """After the server stopped: let the admission threads go (idempotent)."""
        self._opener_pool.shutdown(wait=False, cancel_futures=True)


def add_to_server(servicer: DecodeServicer, server: grpc.Server) -> None:
    """Register the DecodeService like the generated ``add_DecodeServiceServicer_to_server``, except that
    PushKv hands the servicer each chunk as a view of the received message (no protobuf copy) and ProbeLink
    only each message's data size."""
    handlers = {
        "ReserveKv": grpc.unary_unary_rpc_method_handler(
            servicer.ReserveKv,
            request_deserializer=worker_pb2.ReserveKvRequest.FromString,
            response_serializer=worker_pb2.ReserveKvResponse.SerializeToString,
        ),
        "PushKv": grpc.stream_unary_rpc_method_handler(
            servicer.PushKv,
            request_deserializer=chunk_of_push_kv_request,
            response_serializer=worker_pb2.PushKvResponse.SerializeToString,
        ),
        "Decode": grpc.unary_stream_rpc_method_handler(
            servicer.Decode,
            request_deserializer=worker_pb2.DecodeRequest.FromString,
            response_serializer=worker_pb2.DecodeResponse.SerializeToString,
        ),
        "DecodeMany": grpc.stream_stream_rpc_method_handler(
            servicer.DecodeMany,
            request_deserializer=worker_pb2.DecodeManyRequest.FromString,
            response_serializer=worker_pb2.DecodeManyResponse.SerializeToString,
        ),
        "ReleaseKv": grpc.unary_unary_rpc_method_handler(
            servicer.ReleaseKv,
            request_deserializer=worker_pb2.ReleaseKvRequest.FromString,
            response_serializer=worker_pb2.ReleaseKvResponse.SerializeToString,
        ),
        "ProbeLink": grpc.stream_unary_rpc_method_handler(
            servicer.ProbeLink,
            request_deserializer=size_of_probe_link_request,
            response_serializer=worker_pb2.ProbeLinkResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
