"""What the arena transports share (:mod:`~common.kv_transfer.shm`, :mod:`~common.kv_transfer.nixl`): wire chunks
written into slots of an arena the receiver reads, announced by small JSON notes, acknowledged slot by slot.

Sender (:class:`SlotSender`): ``send_layer`` queues; the writer thread cuts each layer into chunks, waits for a free
slot, copies the chunk into it (the one copy: tensor → arena) and has the transport announce it
(:meth:`SlotSender._announce`); the transport's notes come back through :meth:`SlotSender._on_message`: ``ack``
frees a slot, ``done`` / ``failed`` end a request; a broken channel fails every unfinished request
(:meth:`SlotSender._on_broken`).

Receiver (:class:`SlotReceiver`): the table of expected requests, their deadlines and their assemblers; a chunk
announced by a peer (anything with ``view``, the arena as the receiver sees it, and ``send(bytes)``) is checked and
written (:meth:`SlotReceiver._on_chunk`: the one copy arena → KV cache), its slot acknowledged; ``done`` or
``failed`` goes back to the peer whose chunks arrived. The transport owns the I/O thread, calls
:meth:`SlotReceiver._flush_outbox` and :meth:`SlotReceiver._expire_all` from it, and implements ``_wake``.

Control notes are JSON objects (never pickle).
"""

from __future__ import annotations

import collections
import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from common.engine.kv_cache import KVCacheSpec
from common.engine.omp_teams import run_serially
from common.kv_transfer.connector import KVReceiver, KVSender, TransferResult, TransferState
from common.kv_transfer.wire import (
    ALIGN_BYTES,
    ChunkRejectedError,
    TransferAssembler,
    WireFormatError,
    WriteFn,
    check_kv,
    encode_request_id,
    header_size_bytes,
    iter_layer_chunks,
)

MAX_ERROR_CHARS = 2000


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def failed_msg(request_id: str, error: str) -> bytes:
    return encode({"op": "failed", "request_id": request_id, "error": error[:MAX_ERROR_CHARS]})


@dataclass
class _Transfer:
    """One side's record of one request; changed under the owner's condition lock."""

    started_s: float  # time.monotonic()
    state: TransferState = TransferState.PENDING
    error: str = ""
    ended_s: float | None = None
    num_bytes: int = 0  # payload bytes acknowledged (sender) / written (receiver)

    def end(self, state: TransferState, error: str = "") -> bool:
        """Move to a terminal state; False (nothing changes) if already in one."""
        if self.state.is_terminal:
            return False
        self.state, self.error, self.ended_s = state, error, time.monotonic()
        return True

    def result(self) -> TransferResult:
        seconds = (self.ended_s or time.monotonic()) - self.started_s
        return TransferResult(self.state, self.num_bytes, seconds, self.error)


# -- prefill side ----------------------------------------------------------------------------------------------


class _Layer(NamedTuple):
    request_id: str
    layer: int
    k: torch.Tensor  # [n, block_size, num_kv_heads, head_dim]
    v: torch.Tensor


class _Abort(NamedTuple):
    request_id: str


@dataclass
class _Outgoing(_Transfer):
    next_seq: int = 0  # seq of the request's next chunk (written by the writer thread only)


class SlotSender(KVSender):
    """The sending half of an arena transport (see the module doc). A subclass connects, then calls
    ``super().__init__`` with its arena's view, and implements :meth:`_announce` and :meth:`_close_transport`;
    its reader calls :meth:`_on_message` per note and :meth:`_on_broken` when the channel fails.

    ``corrupt_next_chunk`` is a TEST-ONLY fault injection switch: when set, the next chunk gets one payload
    byte flipped in the arena after its checksum was computed; then the switch resets itself.
    """

    def __init__(self, address: str, arena_view: memoryview, *, max_chunk_bytes: int, slot_bytes: int,
                 thread_name: str) -> None:  # fmt: skip
        self.address = address
        self.max_chunk_bytes = max_chunk_bytes
        self.corrupt_next_chunk = False  # TEST ONLY, see the class docstring
        self._slot_bytes = slot_bytes
        self._arena_view = arena_view
        self._cond = threading.Condition()
        self._free_slots = [i * slot_bytes for i in range(len(arena_view) // slot_bytes)]  # arena offsets
        self._in_flight: dict[int, tuple[str, int, float]] = {}  # slot offset -> (request id, payload bytes, sent at)
        self._transfers: dict[str, _Outgoing] = {}
        self._broken = ""  # why the channel is unusable, once it is
        self._closed = False
        self._queue: queue.SimpleQueue[_Layer | _Abort | None] = queue.SimpleQueue()  # None: stop
        self._writer = threading.Thread(target=self._write_loop, name=thread_name, daemon=True)
        self._writer.start()

    @property
    def broken(self) -> str:
        """Why the channel is unusable ('' while it works): every transfer on it fails from then on."""
        with self._cond:
            return self._broken

    @staticmethod
    def slot_size(max_chunk_bytes: int, arena_bytes: int) -> tuple[int, int]:
        """(slot bytes, slots) of an arena of ``arena_bytes`` for chunks of at most ``max_chunk_bytes``."""
        if not ALIGN_BYTES <= max_chunk_bytes <= arena_bytes:
            raise ValueError(f"need {ALIGN_BYTES} <= max_chunk_bytes {max_chunk_bytes} <= arena_bytes {arena_bytes}")
        slot_bytes = -(-max_chunk_bytes // ALIGN_BYTES) * ALIGN_BYTES
        return slot_bytes, arena_bytes // slot_bytes

    def _announce(self, request_id: str, offset: int, length: int) -> None:
        """Tell the receiver that the chunk of ``request_id`` at ``offset`` (``length`` bytes) is in its slot."""
        raise NotImplementedError

    def _send(self, msg: dict) -> None:
        """A control note to the receiver (``abort``)."""
        raise NotImplementedError

    def _close_transport(self) -> None:
        """Stop the reader and free the channel (after the writer stopped)."""
        raise NotImplementedError

    # -- KVSender -----------------------------------------------------------------------------------------------

    def send_layer(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        encode_request_id(request_id)
        check_kv(k, v)
        if layer < 0:
            raise ValueError(f"layer must be >= 0, got {layer}")
        one_block_bytes = header_size_bytes(request_id) + 2 * k[0].numel() * k.element_size()
        if one_block_bytes > self._slot_bytes:
            raise ValueError(f"a chunk of one block takes {one_block_bytes} bytes, more than max_chunk_bytes "
                             f"{self.max_chunk_bytes}")  # fmt: skip
        with self._cond:
            if self._closed:
                raise RuntimeError(f"KV sender to {self.address!r} is closed")
            transfer = self._transfers.setdefault(request_id, _Outgoing(time.monotonic()))
            if transfer.state.is_terminal:
                return  # aborted or failed: nothing more to send
        self._queue.put(_Layer(request_id, layer, k, v))

    def finish(self, request_id: str, timeout_s: float) -> TransferResult:
        until = time.monotonic() + timeout_s
        with self._cond:
            transfer = self._transfers.get(request_id)
            if transfer is None:
                return TransferResult(TransferState.FAILED, 0, 0.0, f"unknown request {request_id!r}")
            while not transfer.state.is_terminal and (left_s := until - time.monotonic()) > 0:
                self._cond.wait(left_s)
            timed_out = transfer.end(
                TransferState.FAILED,
                f"KV of request {request_id!r} not confirmed within {timeout_s}s ({transfer.num_bytes} bytes acked)",
            )
            del self._transfers[request_id]
        if timed_out:
            self._queue.put(_Abort(request_id))
        return transfer.result()

    def poll(self, request_id: str) -> TransferState:
        with self._cond:
            transfer = self._transfers.get(request_id)
            return TransferState.FAILED if transfer is None else transfer.state

    def abort(self, request_id: str) -> None:
        with self._cond:
            transfer = self._transfers.get(request_id)
            if transfer is None or not transfer.end(TransferState.FAILED, f"request {request_id!r} aborted by sender"):
                return
            self._cond.notify_all()
        self._queue.put(_Abort(request_id))

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._fail_all(f"KV sender to {self.address!r} closed")
        self._queue.put(None)
        self._writer.join()
        self._close_transport()

    # -- the writer thread --------------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        run_serially()  # copies KV beside the engine's step: no OpenMP team of its own
        while (item := self._queue.get()) is not None:
            if isinstance(item, _Abort):
                self._send({"op": "abort", "request_id": item.request_id})
                continue
            try:
                self._write_layer(item)
            except Exception as e:  # e.g. a tensor the wire cannot carry: fails this request only
                with self._cond:
                    if (t := self._transfers.get(item.request_id)) and t.end(TransferState.FAILED, repr(e)):
                        self._cond.notify_all()

    def _write_layer(self, item: _Layer) -> None:
        with self._cond:
            transfer = self._transfers.get(item.request_id)
            if transfer is None or transfer.state.is_terminal:
                return
        chunks = iter_layer_chunks(item.request_id, item.layer, item.k, item.v, self.max_chunk_bytes,
                                   first_seq=transfer.next_seq)  # fmt: skip
        for chunk in chunks:
            with self._cond:
                while not (self._free_slots or self._broken or self._closed or transfer.state.is_terminal):
                    self._cond.wait()
                if self._broken or self._closed or transfer.state.is_terminal:
                    transfer.end(TransferState.FAILED, self._broken or "KV sender closed")
                    self._cond.notify_all()
                    return
                offset = self._free_slots.pop()
            chunk.write_into(self._arena_view, offset)  # the one copy: tensor -> arena
            if self.corrupt_next_chunk:  # TEST ONLY fault injection
                self.corrupt_next_chunk = False
                self._arena_view[offset + len(chunk.header_buf)] ^= 0xFF
            with self._cond:
                self._in_flight[offset] = (item.request_id, chunk.header.payload_bytes, time.monotonic())
                transfer.next_seq = chunk.header.seq + 1
                if transfer.state is TransferState.PENDING:
                    transfer.state = TransferState.TRANSFERRING
            self._announce(item.request_id, offset, chunk.num_bytes)

    # -- what the reader hands over -----------------------------------------------------------------------------

    def _on_message(self, msg: dict) -> None:
        with self._cond:
            if msg["op"] == "ack":
                request_id, num_bytes, _ = self._in_flight.pop(msg["offset"])
                self._free_slots.append(msg["offset"])
                if (transfer := self._transfers.get(request_id)) is not None:
                    transfer.num_bytes += num_bytes
            elif (transfer := self._transfers.get(msg["request_id"])) is not None:
                if msg["op"] == "done":
                    transfer.end(TransferState.DONE)
                else:
                    transfer.end(TransferState.FAILED, msg["error"] or "the KV receiver failed the request")
            self._cond.notify_all()

    def _on_broken(self, error: str) -> None:
        with self._cond:
            if not self._closed:
                self._broken = self._broken or error
                self._fail_all(self._broken)

    def _fail_all(self, error: str) -> None:
        """Fail every unfinished transfer (the caller holds the lock)."""
        for transfer in self._transfers.values():
            transfer.end(TransferState.FAILED, error)
        self._cond.notify_all()


# -- decode side -----------------------------------------------------------------------------------------------


class Peer(Protocol):
    """A connected sender as the receiver sees it."""

    view: memoryview | None  # its arena, once known

    def send(self, data: bytes) -> None:
        """A note to the sender; never raises (a gone sender's transfers fail by other means)."""


@dataclass(kw_only=True)
class _Incoming(_Transfer):
    assembler: TransferAssembler
    deadline_at_s: float  # time.monotonic()
    peer: Peer | None = None  # the sender whose chunks arrived, once one did
    feed_lock: threading.Lock = field(default_factory=threading.Lock)  # held while ``write`` may run


class SlotReceiver(KVReceiver):
    """The receiving half of an arena transport (see the module doc). A subclass starts ``self._thread`` (its I/O
    thread, which feeds announced chunks to :meth:`_on_chunk`, and calls :meth:`_flush_outbox` and
    :meth:`_expire_all`) and implements :meth:`_wake`. Lock order: an entry's ``feed_lock`` before the table's
    condition lock; no I/O under either."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._cond = threading.Condition()
        self._expected: dict[str, _Incoming] = {}
        self._outbox: collections.deque[tuple[Peer, bytes]] = collections.deque()  # sent by the I/O thread
        self._closed = False
        self._thread: threading.Thread | None = None

    def _wake(self) -> None:
        """Make the I/O thread look at the outbox and the deadlines now."""
        raise NotImplementedError

    # -- KVReceiver ---------------------------------------------------------------------------------------------

    def expect(
        self, request_id: str, num_layers: int, num_blocks: int, spec: KVCacheSpec, write: WriteFn, deadline_s: float
    ) -> None:
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        assembler = TransferAssembler(request_id, num_layers, num_blocks, spec, write)
        now = time.monotonic()
        with self._cond:
            if self._closed:
                raise RuntimeError(f"KV receiver on {self.address!r} is closed")
            if request_id in self._expected:
                raise ValueError(f"request {request_id!r} is already expected")
            self._expected[request_id] = _Incoming(now, assembler=assembler, deadline_at_s=now + deadline_s)
        self._wake()  # the I/O thread's next deadline may be this one

    def wait(self, request_id: str, timeout_s: float) -> TransferResult:
        until = time.monotonic() + timeout_s
        while True:
            with self._cond:
                entry = self._expected.get(request_id)
                if entry is None:
                    return TransferResult(TransferState.FAILED, 0, 0.0, f"unknown request {request_id!r}")
                while not entry.state.is_terminal and (now := time.monotonic()) < min(until, entry.deadline_at_s):
                    self._cond.wait(min(until, entry.deadline_at_s) - now)
                if entry.state.is_terminal:
                    del self._expected[request_id]
                    return entry.result()
                if time.monotonic() < entry.deadline_at_s:
                    return entry.result()  # timeout_s ran out before the deadline
            self._expire(request_id, entry, blocking=True)

    def poll(self, request_id: str) -> TransferState:
        with self._cond:
            entry = self._expected.get(request_id)
        if entry is None:
            return TransferState.FAILED
        self._expire(request_id, entry, blocking=False)
        return entry.state

    def abort(self, request_id: str) -> None:
        with self._cond:
            entry = self._expected.pop(request_id, None)
        if entry is not None:
            with entry.feed_lock:  # waits for a running write; none starts after this
                self._end(request_id, entry, TransferState.FAILED, f"request {request_id!r} aborted by receiver")

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._wake()
        if self._thread is not None:
            self._thread.join()

    # -- state changes: the caller holds entry.feed_lock ----------------------------------------------------------

    def _end(self, request_id: str, entry: _Incoming, state: TransferState, error: str = "") -> None:
        with self._cond:
            changed = entry.end(state, error)
            self._cond.notify_all()
        if changed and entry.peer is not None:  # tell the sender, from the I/O thread
            done = encode({"op": "done", "request_id": request_id})
            self._outbox.append((entry.peer, failed_msg(request_id, error) if error else done))
            self._wake()

    def _expire(self, request_id: str, entry: _Incoming, *, blocking: bool) -> None:
        """Fail the request if its deadline passed (without blocking: unless a write is running)."""
        if entry.state.is_terminal or time.monotonic() < entry.deadline_at_s:
            return
        if not entry.feed_lock.acquire(blocking=blocking):
            return  # a write is running; the I/O thread expires the request right after it
        try:
            deadline_s = entry.deadline_at_s - entry.started_s
            progress = entry.assembler.describe_progress()
            error = f"KV of request {request_id!r} missed its {deadline_s:.3g}s deadline: {progress}"
            self._end(request_id, entry, TransferState.FAILED, error)
        finally:
            entry.feed_lock.release()

    # -- for the I/O thread ---------------------------------------------------------------------------------------

    def _flush_outbox(self) -> None:
        while self._outbox:
            peer, data = self._outbox.popleft()
            peer.send(data)

    def _expire_all(self) -> None:
        with self._cond:
            entries = list(self._expected.items())
        for request_id, entry in entries:
            self._expire(request_id, entry, blocking=True)

    def _next_timeout_s(self) -> float:
        """Seconds until the nearest deadline (at most 1)."""
        with self._cond:
            deadlines = [e.deadline_at_s for e in self._expected.values() if not e.state.is_terminal]
        return max(0.0, min(deadlines, default=time.monotonic() + 1.0) - time.monotonic())

    def _on_chunk(self, peer: Peer, request_id: str, offset: int, length: int) -> None:
        if not (0 <= offset and 0 < length and offset + length <= len(peer.view)):
            raise ValueError(f"chunk at offset {offset}, length {length} lies outside the {len(peer.view)}-byte arena")
        with self._cond:
            entry = self._expected.get(request_id)
        reply = None
        if entry is None:
            reply = failed_msg(request_id, f"no KV reservation for request {request_id!r} (never made, aborted, "
                                "or already received)")  # fmt: skip
        else:
            with entry.feed_lock:
                entry.peer = peer
                if not entry.state.is_terminal and time.monotonic() < entry.deadline_at_s:
                    self._feed(request_id, entry, peer.view[offset : offset + length])
                elif entry.state is TransferState.FAILED:
                    reply = failed_msg(request_id, entry.error)
        peer.send(encode({"op": "ack", "offset": offset}))  # the slot is the sender's again
        if reply is not None:
            peer.send(reply)

    def _feed(self, request_id: str, entry: _Incoming, chunk: memoryview) -> None:
        try:
            entry.assembler.feed(chunk)  # checks, crc32, write(): the one copy arena -> KV cache
        except (WireFormatError, ChunkRejectedError) as e:
            self._end(request_id, entry, TransferState.FAILED, f"bad KV chunk for request {request_id!r}: {e}")
            return
        except Exception as e:  # raised by the write callback
            self._end(request_id, entry, TransferState.FAILED, f"writing KV of request {request_id!r} failed: {e!r}")
            return
        finally:
            chunk.release()
        with self._cond:
            entry.num_bytes = entry.assembler.num_bytes
            if entry.state is TransferState.PENDING:
                entry.state = TransferState.TRANSFERRING
        if entry.assembler.complete:
            self._end(request_id, entry, TransferState.DONE)

    def _sender_aborted(self, request_id: str) -> None:
        with self._cond:
            entry = self._expected.get(request_id)
        if entry is not None:
            with entry.feed_lock:
                self._end(request_id, entry, TransferState.FAILED, f"request {request_id!r} aborted by sender")

    def _fail_peer(self, peer: Peer, why: str) -> None:
        """Unfinished transfers whose chunks came from ``peer`` fail at once (it is gone)."""
        with self._cond:
            orphans = [(rid, e) for rid, e in self._expected.items() if e.peer is peer]
        for request_id, entry in orphans:
            with entry.feed_lock:
                entry.peer = None
                progress = entry.assembler.describe_progress()
                self._end(request_id, entry, TransferState.FAILED, f"KV of request {request_id!r}: {why} ({progress})")

    def _fail_expected(self, why: str) -> None:
        """Every transfer still expected ends FAILED (the receiver is closing)."""
        with self._cond:
            for entry in self._expected.values():
                entry.end(TransferState.FAILED, why)
            self._cond.notify_all()
