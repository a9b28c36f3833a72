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

import json
import mmap
import os
import re
import secrets
import selectors
import socket
import threading

from common.engine.omp_teams import run_serially
from common.kv_transfer.slots import SlotReceiver, SlotSender, encode
from common.kv_transfer.wire import WIRE_VERSION

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "pdserve-kv-"
_SEGMENT_NAME = re.compile(r"pdserve-kv-[0-9]+-[0-9a-f]+")
_MAX_MESSAGE_BYTES = 65536
_SEND_TIMEOUT_S = 10.0  # a peer that does not read its socket for this long is dropped


# -- prefill side ----------------------------------------------------------------------------------------------


class ShmKVSender(SlotSender):
    """Sends to the :class:`ShmKVReceiver` listening at ``address`` (a Unix socket path), via its own arena.

    The constructor connects (blocking, at most ``connect_timeout_s``) and raises ConnectionError, leaving
    nothing behind, if the receiver is not there or does not map the arena. ``corrupt_next_chunk``: see
    :class:`~common.kv_transfer.slots.SlotSender` (TEST ONLY).
    """

    def __init__(
        self,
        address: str,
        *,
        arena_bytes: int = 64 << 20,
        max_chunk_bytes: int = 4 << 20,
        connect_timeout_s: float = 5.0,
    ) -> None:
        slot_bytes, num_slots = self.slot_size(max_chunk_bytes, arena_bytes)
        self.address = address
        self.segment_name = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        self._arena, self._sock = self._connect(num_slots * slot_bytes, connect_timeout_s)
        super().__init__(address, memoryview(self._arena), max_chunk_bytes=max_chunk_bytes, slot_bytes=slot_bytes,
                         thread_name="shm-kv-writer")  # fmt: skip
        self._reader = threading.Thread(target=self._read_loop, name="shm-kv-reader", daemon=True)
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
            sock.send(encode({"op": "hello", "version": WIRE_VERSION, "segment": self.segment_name, "size": size}))
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

    # -- the transport ------------------------------------------------------------------------------------------

    def _announce(self, request_id: str, offset: int, length: int) -> None:
        self._send({"op": "chunk", "request_id": request_id, "offset": offset, "length": length})

    def _send(self, msg: dict) -> None:
        try:
            self._sock.send(encode(msg))
        except OSError as e:
            self._on_broken(f"lost the connection to KV receiver {self.address!r}: {e}")

    def _close_transport(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the reader
        except OSError:
            pass  # the receiver went away first
        self._reader.join()
        self._sock.close()
        self._arena_view.release()
        self._arena.close()

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


class ShmKVReceiver(SlotReceiver):
    """Receives from any number of :class:`ShmKVSender` on this host; listens on Unix socket ``address``.

    One I/O thread reads every connection, checks the chunks and calls the ``write`` callbacks.
    """

    def __init__(self, address: str) -> None:
        super().__init__(address)
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
        self._thread = threading.Thread(target=self._loop, name="shm-kv-receiver", daemon=True)
        self._thread.start()

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
                self._flush_outbox()
                self._expire_all()
        finally:
            self._shutdown()

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
                peer.send(encode({"op": "error", "error": str(e)}))
                raise ValueError(f"bad hello: {e}") from e
            peer.send(encode({"op": "mapped"}))
        elif op == "chunk" and peer.view is not None:
            self._on_chunk(peer, msg["request_id"], msg["offset"], msg["length"])
        elif op == "abort":
            self._sender_aborted(msg["request_id"])
        else:
            raise ValueError(f"unexpected message {op!r}")

    def _drop(self, peer: _Peer, why: str) -> None:
        """Forget a connection; unfinished transfers whose chunks came through it fail at once."""
        self._selector.unregister(peer.sock)
        self._fail_peer(peer, why)
        peer.close()

    def _shutdown(self) -> None:
        for key in list(self._selector.get_map().values()):
            if isinstance(key.data, _Peer):
                self._drop(key.data, f"KV receiver on {self.address!r} closed")
        self._fail_expected(f"KV receiver on {self.address!r} closed")
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        try:
            os.unlink(self.address)
        except FileNotFoundError:
            pass
