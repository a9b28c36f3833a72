"""Same-host KV transport: chunks travel through shared memory, small JSON notes through a Unix socket.

The life cycle of a connection and of a chunk:

1. :class:`ShmKVReceiver` listens on a Unix ``SOCK_SEQPACKET`` socket at a filesystem path.
2. :class:`ShmKVSender` creates an *arena* ``/dev/shm/pdserve-kv-<pid>-<hex>`` (``arena_bytes``, cut
   into slots of ``max_chunk_bytes``), maps it, connects and says ``hello`` (segment name, size); the
   receiver maps the arena and answers ``mapped``. The sender then unlinks the name at once: both
   mappings stay valid, and no /dev/shm entry outlives the handshake, whichever process dies later.
3. Sender's writer thread, per chunk: waits for a free slot, writes the chunk into it (wire header +
   payload; the one copy tensor → shm), sends ``chunk`` (request id, offset, length).
4. Receiver's I/O thread: feeds the slot to the request's :class:`~common.kv_transfer.wire.TransferAssembler`
   (checks, crc32, then ``write`` straight from the mapped memory: the one copy shm → KV cache), answers
   ``ack`` (the slot is free again), then ``done`` once every block arrived, or ``failed`` with the error
   for a bad chunk, an unknown or aborted request or a passed deadline.
5. Sender's reader thread: ``ack`` frees the slot; ``done`` / ``failed`` end the request; a closed
   socket fails every unfinished request.

Control messages are JSON objects under 64 KiB (never pickle). Access control is the file system's:
the socket path's directory and the arena (mode 0600). Throughput: ``python benchmarks/kv_shm_throughput.py``.
"""

from __future__ import annotations

import collections
import json
import mmap
import os
import queue
import re
import secrets
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from common.engine.kv_cache import KVCacheSpec
from common.engine.omp_teams import run_serially
from common.kv_transfer.connector import KVReceiver, KVSender, TransferResult, TransferState
from common.kv_transfer.wire import (
    ALIGN_BYTES,
    WIRE_VERSION,
    ChunkRejectedError,
    TransferAssembler,
    WireFormatError,
    WriteFn,
    check_kv,
    encode_request_id,
    header_size_bytes,
    iter_layer_chunks,
)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "pdserve-kv-"
_SEGMENT_NAME = re.compile(r"pdserve-kv-[0-9]+-[0-9a-f]+")
_MAX_MESSAGE_BYTES = 65536
_MAX_ERROR_CHARS = 2000
_SEND_TIMEOUT_S = 10.0  # a peer that does not read its socket for this long is dropped


def _encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def _failed_msg(request_id: str, error: str) -> bytes:
    return _encode({"op": "failed", "request_id": request_id, "error": error[:_MAX_ERROR_CHARS]})


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


class ShmKVSender(KVSender):
    """Sends to the :class:`ShmKVReceiver` listening at ``address`` (a Unix socket path), via its own arena.

    The constructor connects (blocking, at most ``connect_timeout_s``) and raises ConnectionError, leaving
    nothing behind, if the receiver is not there or does not map the arena.

    ``corrupt_next_chunk`` is a TEST-ONLY fault injection switch: when set, the next chunk gets one payload
    byte flipped in shared memory after its checksum was computed; then the switch resets itself.
    """

    def __init__(
        self,
        address: str,
        *,
        arena_bytes: int = 64 << 20,
        max_chunk_bytes: int = 4 << 20,
        connect_timeout_s: float = 5.0,
    ) -> None:
        if not ALIGN_BYTES <= max_chunk_bytes <= arena_bytes:
            raise ValueError(f"need {ALIGN_BYTES} <= max_chunk_bytes {max_chunk_bytes} <= arena_bytes {arena_bytes}")
        self.address = address
        self.max_chunk_bytes = max_chunk_bytes
        self.corrupt_next_chunk = False  # TEST ONLY, see the class docstring
        self._slot_bytes = slot_bytes = -(-max_chunk_bytes // ALIGN_BYTES) * ALIGN_BYTES
        num_slots = arena_bytes // slot_bytes
        self.segment_name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self._arena, self._sock = self._connect(num_slots * slot_bytes, connect_timeout_s)
        self._arena_view = memoryview(self._arena)
        self._cond = threading.Condition()
        self._free_slots = [i * slot_bytes for i in range(num_slots)]  # arena offsets
        self._in_flight: dict[int, tuple[str, int]] = {}  # slot offset -> (request id, payload bytes)
        self._transfers: dict[str, _Outgoing] = {}
        self._broken = ""  # why the connection is unusable, once it is
        self._closed = False
        self._queue: queue.SimpleQueue[_Layer | _Abort | None] = queue.SimpleQueue()  # None: stop
        self._writer = threading.Thread(target=self._write_loop, name="shm-kv-writer", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="shm-kv-reader", daemon=True)
        self._writer.start()
        self._reader.start()

    def _connect(self, size: int, timeout_s: float) -> tuple[mmap.mmap, socket.socket]:
        path = os.path.join(SHM_DIR, self.segment_name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        arena = sock = None
        try:
            os.ftruncate(fd, size)
            arena = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)  # fault the pages in now, once
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.settimeout(timeout_s)
            sock.connect(self.address)
            sock.send(_encode({"op": "hello", "version": WIRE_VERSION, "segment": self.segment_name, "size": size}))
            reply = json.loads(sock.recv(_MAX_MESSAGE_BYTES) or b'{"error": "connection closed"}')
            if reply.get("op") != "mapped":
                raise ConnectionError(f"receiver refused the arena: {reply.get('error', reply)}")
            sock.settimeout(_SEND_TIMEOUT_S)
            return arena, sock
        except (OSError, ValueError) as e:
            for resource in (sock, arena):
                if resource is not None:
                    resource.close()
            raise ConnectionError(f"cannot open a KV channel to {self.address!r}: {e}") from e
        finally:
            os.close(fd)
            os.unlink(path)  # the receiver mapped it (or never will): the name has done its job

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
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader
        except OSError:
            pass  # the receiver went away first
        self._reader.join()
        self._sock.close()
        self._arena_view.release()
        self._arena.close()

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
            chunk.write_into(self._arena_view, offset)  # the one copy: tensor -> shared memory
            if self.corrupt_next_chunk:  # TEST ONLY fault injection
                self.corrupt_next_chunk = False
                self._arena_view[offset + len(chunk.header_buf)] ^= 0xFF
            with self._cond:
                self._in_flight[offset] = (item.request_id, chunk.header.payload_bytes)
                transfer.next_seq = chunk.header.seq + 1
                if transfer.state is TransferState.PENDING:
                    transfer.state = TransferState.TRANSFERRING
            self._send({"op": "chunk", "request_id": item.request_id, "offset": offset, "length": chunk.num_bytes})

    def _send(self, msg: dict) -> None:
        try:
            self._sock.send(_encode(msg))
        except OSError as e:
            self._on_broken(f"lost the connection to KV receiver {self.address!r}: {e}")

    # -- the reader thread --------------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        run_serially()
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE_BYTES)
            except TimeoutError:
                continue  # idle: nothing in flight
            except OSError:
                data = b""
            if not data:
                self._on_broken(f"lost the connection to KV receiver {self.address!r}: closed by the receiver")
                return
            try:
                self._on_message(json.loads(data))
            except (ValueError, KeyError, TypeError) as e:
                self._on_broken(f"protocol error from KV receiver {self.address!r}: {e!r} in {data[:200]!r}")
                return

    def _on_message(self, msg: dict) -> None:
        with self._cond:
            if msg["op"] == "ack":
                request_id, num_bytes = self._in_flight.pop(msg["offset"])
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


class _Peer:
    """One connected sender: its socket and, after ``hello``, its mapped arena."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.arena: mmap.mmap | None = None
        self.view: memoryview | None = None

    def map_arena(self, hello: dict) -> None:
        name, size = hello.get("segment"), hello.get("size")
        if hello.get("version") != WIRE_VERSION:
            raise ValueError(f"sender speaks wire version {hello.get('version')}, this receiver {WIRE_VERSION}")
        if not isinstance(name, str) or not _SEGMENT_NAME.fullmatch(name):
            raise ValueError(f"bad segment name {name!r}")
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"segment {name} has {os.fstat(fd).st_size} bytes, hello said {size}")
            self.arena = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self.view = memoryview(self.arena)

    def send(self, data: bytes) -> None:
        try:
            self.sock.send(data)
        except OSError:
            pass  # the sender is gone; its transfers fail when the I/O thread sees the connection close

    def close(self) -> None:
        self.sock.close()
        if self.view is not None:
            self.view.release()
            try:
                self.arena.close()
            except BufferError:
                pass  # a write callback kept a view of the arena: the mapping goes with that view


@dataclass(kw_only=True)
class _Incoming(_Transfer):
    assembler: TransferAssembler
    deadline_at_s: float  # time.monotonic()
    peer: _Peer | None = None  # the sender whose chunks arrived, once one did
    feed_lock: threading.Lock = field(default_factory=threading.Lock)  # held while ``write`` may run


class ShmKVReceiver(KVReceiver):
    """Receives from any number of :class:`ShmKVSender` on this host; listens on Unix socket ``address``.

    One I/O thread reads every connection, checks the chunks and calls the ``write`` callbacks. Lock
    order: an entry's ``feed_lock`` before the table's condition lock; no socket I/O under either.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._listener.bind(address)
        except OSError as e:
            self._listener.close()
            raise OSError(f"cannot listen for KV on {address!r}: {e}") from e
        self._listener.listen(64)
        self._listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._cond = threading.Condition()
        self._expected: dict[str, _Incoming] = {}
        self._outbox: collections.deque[tuple[_Peer, bytes]] = collections.deque()  # sent by the I/O thread
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="shm-kv-receiver", daemon=True)
        self._thread.start()

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
        self._thread.join()

    # -- state changes: the caller holds entry.feed_lock ----------------------------------------------------------

    def _end(self, request_id: str, entry: _Incoming, state: TransferState, error: str = "") -> None:
        with self._cond:
            changed = entry.end(state, error)
            self._cond.notify_all()
        if changed and entry.peer is not None:  # tell the sender, from the I/O thread
            done = _encode({"op": "done", "request_id": request_id})
            self._outbox.append((entry.peer, _failed_msg(request_id, error) if error else done))
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

    # -- the I/O thread -----------------------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # closed, or full: a wake-up is pending anyway

    def _loop(self) -> None:
        run_serially()  # writes KV beside the engine's step: no OpenMP team of its own
        try:
            while not self._closed:
                for key, _ in self._selector.select(self._next_timeout_s()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._drain_wakeups()
                    else:
                        self._on_readable(key.data)
                while self._outbox:
                    peer, data = self._outbox.popleft()
                    peer.send(data)
                with self._cond:
                    entries = list(self._expected.items())
                for request_id, entry in entries:
                    self._expire(request_id, entry, blocking=True)
        finally:
            self._shutdown()

    def _next_timeout_s(self) -> float:
        with self._cond:
            deadlines = [e.deadline_at_s for e in self._expected.values() if not e.state.is_terminal]
        return max(0.0, min(deadlines, default=time.monotonic() + 1.0) - time.monotonic())

    def _drain_wakeups(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except BlockingIOError:
            return
        sock.settimeout(_SEND_TIMEOUT_S)
        self._selector.register(sock, selectors.EVENT_READ, _Peer(sock))

    def _on_readable(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(_MAX_MESSAGE_BYTES)
        except OSError:
            data = b""
        if not data:
            self._drop(peer, "the KV sender closed its connection")
            return
        try:
            self._dispatch(peer, json.loads(data))
        except (KeyError, TypeError, ValueError) as e:
            self._drop(peer, f"protocol error: {e!r} in message {data[:200]!r}")

    def _dispatch(self, peer: _Peer, msg: dict) -> None:
        op = msg["op"]
        if op == "hello" and peer.view is None:
            try:
                peer.map_arena(msg)
            except (OSError, ValueError) as e:
                peer.send(_encode({"op": "error", "error": str(e)}))
                raise ValueError(f"bad hello: {e}") from e
            peer.send(_encode({"op": "mapped"}))
        elif op == "chunk" and peer.view is not None:
            self._on_chunk(peer, msg["request_id"], msg["offset"], msg["length"])
        elif op == "abort":
            with self._cond:
                entry = self._expected.get(msg["request_id"])
            if entry is not None:
                with entry.feed_lock:
                    self._end(msg["request_id"], entry, TransferState.FAILED, f"request {msg['request_id']!r} "
                              "aborted by sender")  # fmt: skip
        else:
            raise ValueError(f"unexpected message {op!r}")

    def _on_chunk(self, peer: _Peer, request_id: str, offset: int, length: int) -> None:
        if not (0 <= offset and 0 < length and offset + length <= len(peer.view)):
            raise ValueError(f"chunk at offset {offset}, length {length} lies outside the {len(peer.view)}-byte arena")
        with self._cond:
            entry = self._expected.get(request_id)
        reply = None
        if entry is None:
            reply = _failed_msg(request_id, f"no KV reservation for request {request_id!r} (never made, aborted, "
                                "or already received)")  # fmt: skip
        else:
            with entry.feed_lock:
                entry.peer = peer
                if not entry.state.is_terminal and time.monotonic() < entry.deadline_at_s:
                    self._feed(request_id, entry, peer.view[offset : offset + length])
                elif entry.state is TransferState.FAILED:
                    reply = _failed_msg(request_id, entry.error)
        peer.send(_encode({"op": "ack", "offset": offset}))  # the slot is the sender's again
        if reply is not None:
            peer.send(reply)

    def _feed(self, request_id: str, entry: _Incoming, chunk: memoryview) -> None:
        try:
            entry.assembler.feed(chunk)  # checks, crc32, write(): the one copy shm -> KV cache
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

    def _drop(self, peer: _Peer, why: str) -> None:
        """Forget a connection; unfinished transfers whose chunks came through it fail at once."""
        self._selector.unregister(peer.sock)
        with self._cond:
            orphans = [(rid, e) for rid, e in self._expected.items() if e.peer is peer]
        for request_id, entry in orphans:
            with entry.feed_lock:
                entry.peer = None
                progress = entry.assembler.describe_progress()
                self._end(request_id, entry, TransferState.FAILED, f"KV of request {request_id!r}: {why} ({progress})")
        peer.close()

    def _shutdown(self) -> None:
        for key in list(self._selector.get_map().values()):
            if isinstance(key.data, _Peer):
                self._drop(key.data, f"KV receiver on {self.address!r} closed")
        with self._cond:
            for entry in self._expected.values():
                entry.end(TransferState.FAILED, f"KV receiver on {self.address!r} closed")
            self._cond.notify_all()
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        try:
            os.unlink(self.address)
        except FileNotFoundError:
            pass
