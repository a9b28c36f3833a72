"""KV transport over NIXL (NVIDIA's inference transfer library, ``pip install 'pdserve[nixl]'``): each chunk lands
in the receiver's memory by a one-sided NIXL ``WRITE`` (UCX underneath: shared memory, TCP or RDMA, whatever it
finds between the hosts), announced by the write's own notification; the protocol above it is the arena protocol
of :mod:`~common.kv_transfer.slots`, as for shared memory, but across hosts.

The life cycle of a channel and of a chunk:

1. :class:`NixlKVReceiver` (decode) holds a NIXL agent; its ``metadata`` (a few hundred bytes: the agent's name
   and UCX addresses) travels to prefill workers inside the ReserveKv answer and the Prefill request.
2. :class:`NixlKVSender` (prefill, one per decode worker) creates its own agent and a staging arena registered
   with it, loads the receiver's metadata and says ``hello`` (its arena size and its own metadata); the receiver
   loads the sender's metadata, allocates and registers a landing arena of that size for it, answers ``arena``
   (address and size, and its metadata again: now with that registration, which the sender's writes need).
3. Sender's writer thread, per chunk: waits for a free slot, writes the chunk into its staging slot (the one copy
   tensor → staging), then a ``WRITE`` of that slot to the same offset of the landing arena, whose notification
   ``chunk`` (request id, offset, length) reaches the receiver once the bytes are there.
4. Receiver's I/O thread polls notifications: ``chunk`` → the wire checks and ``write`` from the landing arena
   (the one copy arena → KV cache), then ``ack`` (the slot is free again), ``done`` / ``failed`` per request.
5. Sender's reader thread polls notifications (``ack``, ``done``, ``failed``) and its writes' states: a write
   that ends in error breaks the channel, failing its requests.

No listener: metadata go through the services' own calls, and the UCX traffic of the writes. NIXL tells neither
side when the other is gone: the receiver's deadlines, the sender's watch of the receiver's silence (``stall_s``)
and its ``finish`` timeout end such transfers, and
a sender silent for ``peer_idle_s`` (15 minutes) loses its landing arena (it is told ``dropped``; one still there
opens a new channel). A closing sender says ``bye`` after its last write completed; a dropped arena is
deregistered at once and its memory freed a minute later, so a write still on its way never lands in memory the
receiver reuses.
Both arenas are host memory (the KV given to ``send_layer`` is a copy, on the GPU staged to the host first).
Notes are JSON objects (never pickle); a ``hello`` carries the sender's NIXL metadata after a newline.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable

import torch

from common.engine.kv_cache import PagedKVCache
from common.engine.omp_teams import run_serially
from common.kv_transfer.connector import TransferState
from common.kv_transfer.nixl_landing import BlockLanding
from common.kv_transfer.slots import SlotReceiver, SlotSender, encode
from common.kv_transfer.wire import WIRE_VERSION

_POLL_S = 0.0002  # notification polling while chunks are in flight
_AWAIT_POLL_S = 0.001  # ... while a reservation waits for its first chunk (a poll costs ~25 us of a core)
_IDLE_POLL_S = 0.005  # ... with nothing in flight
# NIXL's UCX progress thread: off unless PDSERVE_NIXL_PROGRESS_THREAD=1. Both sides poll NIXL anyway (the calls
# above progress the UCX worker); with the thread on, a write's completion waited for the thread's next wake-up
# (it sleeps on UCX's event fd, which a shared-memory write's completion does not signal) and the thread took
# cores from the engine: measured on 2 cores 1.33-1.41 GB/s with it vs 1.79-2.23 without (256 MiB between two
# processes), and over TCP alone 0.67 vs 1.19 GB/s (docs/benchmarks.md).
PROGRESS_THREAD_ENV = "PDSERVE_NIXL_PROGRESS_THREAD"
log = logging.getLogger(__name__)
MAX_ARENA_BYTES = 256 << 20  # the most landing memory one sender may ask a receiver for
PEER_IDLE_S = 900.0  # a sender silent this long loses its landing arena (see NixlKVReceiver)
ARENA_GRACE_S = 60.0  # a dropped sender's landing arena is freed this long after its deregistration
# A sender's watch for a lost link (``stall_s``, the prefill worker's --kv-write-stall-s): NIXL reports no peer's
# loss, and a write or note to a host that became unreachable stays in progress (UCX over TCP retransmits) until
# the request's own timeout. A receiver silent for ``stall_s`` while the sender awaits it (a grant, an ack, a
# write's completion, a confirmation), plus a second per STALL_MIN_BYTES_PER_S of the writes outstanding (a long
# prompt's write on a slow link is silent for a while too), breaks the channel: its requests fail at once and
# are retried. A gRPC transfer has keepalive pings for this.
STALL_MIN_BYTES_PER_S = 1 << 20
# UCX over TCP, unless the environment sets it: a connection to a host that does not answer fails after 2 SYN
# retransmissions (~7 s; with the kernel's default, measured 133 s, NIXL's add_remote_agent held the agent, so
# every channel of the process). Not UCX_TCP_USER_TIMEOUT: it ends an established connection whose peer is away
# a while (6.0 s with 5s), but one kept survives the split and serves once it heals, where a killed one failed
# the first hand-offs after it (their channels looked fine until a later send); the silence watch above ends the
# transfers meanwhile. Measured across virtual hosts (docs/benchmarks.md). RDMA transports have timeouts of their
# own.
UCX_TCP_DEFAULTS = {"UCX_TCP_SYN_CNT": "2"}


def overdue(stall_s: float, quiet_since_s: float, outstanding_bytes: int, now: float) -> bool:
    """Whether a receiver quiet since ``quiet_since_s`` with ``outstanding_bytes`` of writes on their way to it is
    past the stall allowance (never with ``stall_s`` <= 0)."""
    return stall_s > 0 and now - quiet_since_s > stall_s + outstanding_bytes / STALL_MIN_BYTES_PER_S


# Memory a NIXL write may still reach after its channel ended (a dropped or closed channel's landing arena, the
# staging arena of a sender closed with writes unfinished): kept alive ARENA_GRACE_S, then let go. A write on its
# way must never land in, or read from, memory the process has reused (UCX's shared-memory transports write to
# the address itself).
_graveyard: list[tuple[float, object]] = []
_graveyard_lock = threading.Lock()


def _bury(memory: object) -> None:
    with _graveyard_lock:
        _graveyard.append((time.monotonic() + ARENA_GRACE_S, memory))
    _free_expired()


def _free_expired() -> None:
    now = time.monotonic()
    with _graveyard_lock:
        while _graveyard and _graveyard[0][0] <= now:
            _graveyard.pop(0)


def nixl_api():
    """NIXL's Python API module (``nixl_agent``, ``nixl_agent_config``), or None when it is not installed."""
    for name in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = __import__(name, fromlist=["nixl_agent"])
        except Exception:  # noqa: BLE001  (not installed, or a backend built for another CUDA)
            continue
        _nixl_logging_to_ours()
        return api
    return None


def _nixl_logging_to_ours() -> None:
    """NIXL's Python logger prints INFO lines to stdout (where ``--json`` output and our JSON logs go): its records
    go through this process's logging instead, from WARNING up unless ``NIXL_LOG_LEVEL`` says otherwise."""
    logger = logging.getLogger("nixl")
    for handler in list(logger.handlers):
        if getattr(handler, "stream", None) is sys.stdout:
            logger.removeHandler(handler)
    logger.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logger.setLevel(logging.WARNING)


def unavailable_reason() -> str:
    """'' when NIXL imports, else why not (for logs and test skips)."""
    return "" if nixl_api() is not None else "NIXL is not installed (pip install 'pdserve[nixl]')"


def progress_thread() -> bool:
    """Whether NIXL agents run UCX's progress thread (``PDSERVE_NIXL_PROGRESS_THREAD``, 0 or 1; ValueError else)."""
    value = os.environ.get(PROGRESS_THREAD_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{PROGRESS_THREAD_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def settings_error() -> str:
    """'' when ``PDSERVE_NIXL_PROGRESS_THREAD`` and ``PDSERVE_NIXL_BLOCKS`` are 0 or 1 (or unset), else which is not."""
    from common.kv_transfer.nixl_blocks import blocks_enabled  # (it builds on this module)

    try:
        progress_thread()
        blocks_enabled()
    except ValueError as exc:
        return str(exc)
    return ""


def setup_error() -> str:
    """'' when NIXL agents can be made here, else why not: a bad setting (:func:`settings_error`) or NIXL not
    installed (what a decode worker with ``--kv-nixl`` checks before it starts)."""
    return settings_error() or unavailable_reason()


def _new_agent(role: str):
    api = nixl_api()
    if api is None:
        raise RuntimeError(unavailable_reason())
    for key, value in UCX_TCP_DEFAULTS.items():  # read by UCX as the agent starts
        os.environ.setdefault(key, value)
    name = f"pdserve-kv-{role}-{os.getpid()}-{secrets.token_hex(4)}"
    return name, api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=progress_thread(), backends=["UCX"]))


def _notifs(agent, lock: threading.Lock) -> list[tuple[str, bytes]]:
    with lock:
        got = agent.get_new_notifs()
    return [(peer, msg) for peer, msgs in got.items() for msg in msgs]


# -- prefill side ----------------------------------------------------------------------------------------------


class NixlKVSender(SlotSender):
    """Sends to the :class:`NixlKVReceiver` whose ``metadata`` it is given, via its own staging arena.

    The constructor connects (blocking, at most ``connect_timeout_s``) and raises ConnectionError, leaving
    nothing behind, if the receiver does not answer with a landing arena. ``address`` names the receiver in
    messages (its agent's name). ``stall_s``: the lost-link watch (:data:`STALL_MIN_BYTES_PER_S`; 0: none).
    ``corrupt_next_chunk``: see :class:`~common.kv_transfer.slots.SlotSender`.
    """

    def __init__(self, metadata: bytes, *, arena_bytes: int = 64 << 20, max_chunk_bytes: int = 4 << 20,
                 connect_timeout_s: float = 5.0, stall_s: float = 0.0) -> None:  # fmt: skip
        slot_bytes, num_slots = self.slot_size(max_chunk_bytes, min(arena_bytes, MAX_ARENA_BYTES))
        size = num_slots * slot_bytes
        self._stall_s = stall_s  # see STALL_MIN_BYTES_PER_S; 0: no watch
        self._heard_s = time.monotonic()  # the receiver's last sign of life: a note, a write completed
        self.name, self._agent = _new_agent("send")
        self._lock = threading.Lock()  # one NIXL call at a time from this side's threads
        self._staging = torch.zeros(size, dtype=torch.uint8)
        self._handles: list = []  # WRITEs not yet DONE (reader thread)
        self._wake = threading.Event()
        self._closing_until = 0.0  # once closed: the reader waits this long for unfinished writes
        try:
            self._registered = self._agent.register_memory(self._staging)
            self.receiver = self._agent.add_remote_agent(metadata)
            self.receiver = self.receiver.decode() if isinstance(self.receiver, bytes) else self.receiver
            self._landing = self._connect(size, connect_timeout_s)
        except Exception as e:
            self._release()
            raise ConnectionError(f"cannot open a NIXL KV channel: {e}") from e
        super().__init__(self.receiver, memoryview(self._staging.numpy()), max_chunk_bytes=max_chunk_bytes,
                         slot_bytes=slot_bytes, thread_name="nixl-kv-writer")  # fmt: skip
        self._reader = threading.Thread(target=self._read_loop, name="nixl-kv-reader", daemon=True)
        self._reader.start()

    def _connect(self, size: int, timeout_s: float) -> int:
        """Say hello; returns the landing arena's address once the receiver answers ``arena``."""
        hello = encode({"op": "hello", "version": WIRE_VERSION, "size": size})
        hello += b"\n" + self._agent.get_agent_metadata()
        with self._lock:
            self._agent.send_notif(self.receiver, hello)
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            for peer, msg in _notifs(self._agent, self._lock):
                head, _, metadata = msg.partition(b"\n")
                reply = json.loads(head) if peer == self.receiver else {}
                if reply.get("op") == "arena" and reply.get("size") == size:
                    with self._lock:
                        self._agent.add_remote_agent(metadata)  # now with the landing arena registered
                    return int(reply["addr"])
                if reply.get("op") == "error":
                    raise ConnectionError(f"the receiver refused the channel: {reply.get('error')}")
            time.sleep(_POLL_S * 5)
        raise ConnectionError(f"no answer from NIXL KV receiver {self.receiver} within {timeout_s}s")

    # -- the transport ------------------------------------------------------------------------------------------

    def _announce(self, request_id: str, offset: int, length: int) -> None:
        note = encode({"op": "chunk", "request_id": request_id, "offset": offset, "length": length})
        try:
            with self._lock:
                local = self._agent.get_xfer_descs(self._staging[offset : offset + length])
                remote = self._agent.get_xfer_descs([(self._landing + offset, length, 0)], "DRAM")
                handle = self._agent.initialize_xfer("WRITE", local, remote, self.receiver, note)
                state = self._agent.transfer(handle)
        except Exception as e:  # noqa: BLE001  (NIXL raises its own error types)
            self._on_broken(f"NIXL write to KV receiver {self.receiver} failed: {e!r}")
            return
        if state == "ERR":
            self._on_broken(f"NIXL write to KV receiver {self.receiver} failed")
        with self._cond:
            self._handles.append(handle)
        self._wake.set()

    def _send(self, msg: dict) -> None:
        try:
            with self._lock:
                self._agent.send_notif(self.receiver, encode(msg))
        except Exception as e:  # noqa: BLE001
            self._on_broken(f"lost the NIXL channel to KV receiver {self.receiver}: {e!r}")

    def _close_transport(self) -> None:
        self._closing_until = time.monotonic() + 1.0
        self._wake.set()
        self._reader.join()  # after the writes still running (at most a second)
        self._send({"op": "bye"})  # the receiver may free the landing arena now
        self._arena_view.release()
        self._release()

    def _release(self) -> None:
        if self._handles:  # writes that did not finish may still read the staging arena
            _bury(self._staging)
        with self._lock:
            for handle in self._handles:
                try:
                    self._agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001, S110  (an unfinished write: its memory goes with the agent)
                    pass
            self._handles = []
            registered = getattr(self, "_registered", None)
            if registered is not None:
                self._agent.deregister_memory(registered)
                self._registered = None
            if isinstance(getattr(self, "receiver", None), str):
                try:
                    self._agent.remove_remote_agent(self.receiver)
                except Exception:  # noqa: BLE001, S110
                    pass

    # -- the reader thread --------------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        run_serially()
        while True:
            for peer, msg in _notifs(self._agent, self._lock):
                if peer != self.receiver:
                    continue
                self._heard_s = time.monotonic()
                try:
                    note = json.loads(msg)
                    if note.get("op") == "dropped":  # the receiver forgot this channel: the pool opens a new one
                        self._on_broken(note.get("error") or f"KV receiver {self.receiver} dropped the channel")
                        continue
                    self._on_message(note)
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    self._on_broken(f"protocol error from KV receiver {self.receiver}: {e!r} in {msg[:200]!r}")
            self._check_writes()
            self._check_silence()
            with self._cond:
                closed, writing, busy = self._closed, bool(self._handles), bool(self._in_flight or self._handles)
            if closed and (not writing or time.monotonic() > self._closing_until):
                return
            self._wake.wait(_POLL_S if busy else _IDLE_POLL_S)
            self._wake.clear()

    def _check_writes(self) -> None:
        with self._cond:
            handles = list(self._handles)
        done, failed = [], False
        for handle in handles:
            with self._lock:
                state = self._agent.check_xfer_state(handle)
                if state in ("DONE", "ERR"):
                    self._agent.release_xfer_handle(handle)
            if state in ("DONE", "ERR"):
                done.append(handle)
                failed |= state == "ERR"
        if done:
            self._heard_s = time.monotonic()
            with self._cond:
                self._handles = [h for h in self._handles if h not in done]
        if failed:
            self._on_broken(f"a NIXL write to KV receiver {self.receiver} failed")

    def _check_silence(self) -> None:
        """Break the channel when chunks await their acks from a receiver silent past the stall allowance."""
        now = time.monotonic()
        with self._cond:
            if self._broken or not self._in_flight:
                return
            since_s = max(self._heard_s, min(sent_s for _, _, sent_s in self._in_flight.values()))
            outstanding = sum(num_bytes for _, num_bytes, _ in self._in_flight.values())
            chunks = len(self._in_flight)
        if overdue(self._stall_s, since_s, outstanding, now):
            self._on_broken(f"KV receiver {self.receiver} silent for {now - since_s:.1f}s with {chunks} chunks "
                            f"unacknowledged (--kv-write-stall-s {self._stall_s:g}): its link is lost")


# -- decode side -----------------------------------------------------------------------------------------------


class _NixlPeer:
    """One sender: its agent name and, after ``hello``, the landing arena registered for it."""

    def __init__(self, receiver: NixlKVReceiver, name: str) -> None:
        self.receiver = receiver
        self.name = name
        self.arena: torch.Tensor | None = None
        self.view: memoryview | None = None
        self.registered = None
        self.blocks = False  # writes straight into the KV cache (nixl_blocks) instead of into an arena
        self.last_seen_s = time.monotonic()  # its last note

    def send(self, data: bytes) -> None:
        try:
            with self.receiver._nixl_lock:
                self.receiver._agent.send_notif(self.name, data)
        except Exception:  # noqa: BLE001, S110  (a gone sender: its transfers fail by their deadline)
            pass

    def close(self) -> None:
        """Deregister its arena and forget its agent; the caller buries the arena's memory (``_bury``)."""
        agent = self.receiver._agent
        with self.receiver._nixl_lock:
            if self.registered is not None:
                agent.deregister_memory(self.registered)
                self.registered = None
            try:
                agent.remove_remote_agent(self.name)
            except Exception:  # noqa: BLE001, S110
                pass


class NixlKVReceiver(SlotReceiver):
    """Receives from any number of :class:`NixlKVSender`, on this host or others; ``metadata`` is what senders
    need to reach it, ``address`` its agent's name. One I/O thread polls NIXL's notifications, checks the chunks
    and calls the ``write`` callbacks. Given the decode engine's ``kv_cache``, it also takes direct block writes
    from :class:`~common.kv_transfer.nixl_blocks.NixlBlockSender` into the blocks offered (:meth:`offer_blocks`)."""

    def __init__(self, *, max_arena_bytes: int = MAX_ARENA_BYTES, peer_idle_s: float = PEER_IDLE_S,
                 kv_cache: PagedKVCache | None = None, on_block_bytes: Callable[[int], None] | None = None,
                 ) -> None:  # fmt: skip
        """``peer_idle_s``: a sender silent this long (a prefill worker that died without saying bye) loses its
        landing arena; a sender that comes back after it finds its writes failing and connects again.
        ``kv_cache``: registered with the agent for direct block writes (None: arenas only); ``on_block_bytes``
        is told the bytes of each request that landed so (the metrics' received bytes)."""
        name, self._agent = _new_agent("recv")
        super().__init__(name)
        self.max_arena_bytes = max_arena_bytes
        self.peer_idle_s = peer_idle_s
        self._nixl_lock = threading.Lock()
        self.blocks = None
        if kv_cache is not None:
            try:
                self.blocks = BlockLanding(self, kv_cache, on_block_bytes)
            except Exception as e:  # noqa: BLE001  (NIXL's own errors: e.g. a UCX build that cannot register VRAM)
                log.warning("NIXL cannot register the %s KV cache (%r): no direct block writes, arenas only",
                            kv_cache.data.device, e)  # fmt: skip
        self.metadata: bytes = self._agent.get_agent_metadata()
        self._peers: dict[str, _NixlPeer] = {}
        self._woken = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nixl-kv-receiver", daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        self._woken.set()

    # -- direct block writes (for the decode servicer) -------------------------------------------------------------

    def offer_blocks(self, request_id: str, block_ids: list[int]) -> bool:
        """After :meth:`expect`: let a block sender claim the reservation's ``block_ids`` and write them directly.
        False (nothing offered) when this receiver has no KV cache registered."""
        if self.blocks is None:
            return False
        self.blocks.offer(request_id, block_ids)
        return True

    def hold(self, request_id: str) -> str | None:
        """Keep a failed request's blocks from reuse while its block sender may still write them, under a key of
        their own (returned; None: no sender was granted them): ``writing(key)`` says when they may go."""
        return None if self.blocks is None else self.blocks.hold(request_id)

    def writing(self, request_id: str) -> bool:
        """Whether a block sender's writes may still land in the request's blocks. The decode worker frees a
        reservation only once this is False, even after :meth:`abort` (a sender's writes need no help from this
        side; it says quiet once they completed, or its grant runs out at the deadline + ``GRANT_GRACE_S``)."""
        return self.blocks is not None and self.blocks.writing(request_id)

    # -- the I/O thread -----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        run_serially()  # writes KV beside the engine's step: no OpenMP team of its own
        try:
            while not self._closed:
                got = _notifs(self._agent, self._nixl_lock)
                for peer, msg in got:
                    self._on_note(peer, msg)
                self._flush_outbox()
                self._expire_all()
                self._drop_idle_peers()
                if self.blocks is not None:
                    self.blocks.expire()
                _free_expired()
                with self._cond:
                    open_ = [e for e in self._expected.values() if not e.state.is_terminal]
                    busy = bool(got) or any(e.peer is not None for e in open_)
                # NIXL has nothing to block on: a reservation's first chunk waits for the next poll (it waited up to
                # the idle poll, 5 ms, and with the sender's slots taken meanwhile so did its later chunks)
                poll_s = _POLL_S if busy else _AWAIT_POLL_S if open_ else _IDLE_POLL_S
                self._woken.wait(min(poll_s, self._next_timeout_s()))
                self._woken.clear()
        finally:
            why = f"KV receiver {self.address} closed"
            with self._cond:
                entries = list(self._expected.items())
            for request_id, entry in entries:
                with entry.feed_lock:
                    self._end(request_id, entry, TransferState.FAILED, why)
            self._flush_outbox()  # the senders hear of it
            for peer in list(self._peers.values()):
                peer.close()
                _bury(peer.arena)
            self._fail_expected(why)
            if self.blocks is not None:
                self.blocks.close()

    def _drop_idle_peers(self) -> None:
        now = time.monotonic()
        with self._cond:
            busy = {id(e.peer) for e in self._expected.values() if not e.state.is_terminal and e.peer is not None}
        for peer in [p for p in self._peers.values() if now - p.last_seen_s > self.peer_idle_s and id(p) not in busy]:
            why = f"the KV receiver dropped a channel silent for {self.peer_idle_s:g}s"
            peer.send(encode({"op": "dropped", "error": why}))  # a sender still there opens a new one
            self._drop(peer, why)

    def _on_note(self, name: str, msg: bytes) -> None:
        if name in self._peers:
            self._peers[name].last_seen_s = time.monotonic()
        head, _, extra = msg.partition(b"\n")
        try:
            note = json.loads(head)
            op = note["op"]
            peer = self._peers.get(name)
            if op == "hello":
                self._hello(name, note, extra)
            elif peer is None or (peer.view is None and not peer.blocks):
                raise ValueError(f"{op!r} before hello")
            elif peer.blocks and op in ("claim", "layers", "quiet"):
                self._on_block_note(peer, op, note)
            elif op == "chunk" and not peer.blocks:
                self._on_chunk(peer, note["request_id"], note["offset"], note["length"])
            elif op == "abort":
                self._sender_aborted(note["request_id"])
            elif op == "bye":
                self._drop(peer, "the KV sender closed its channel", said_bye=True)
            else:
                raise ValueError(f"unexpected message {op!r}")
        except (KeyError, TypeError, ValueError) as e:
            peer = self._peers.get(name)
            if peer is not None:
                self._drop(peer, f"protocol error: {e!r} in message {msg[:200]!r}")

    def _on_block_note(self, peer: _NixlPeer, op: str, note: dict) -> None:
        request_id = note["request_id"]
        if op == "claim":
            self.blocks.on_claim(peer, request_id, [int(b) for b in note["blocks"]])
        elif op == "layers":
            for layer, checksum in zip(note["layers"], note["sums"], strict=True):
                self.blocks.on_layer(peer, request_id, int(layer), int(checksum))
        else:
            self.blocks.on_quiet(peer, request_id)

    def _hello(self, name: str, note: dict, metadata: bytes) -> None:
        if name in self._peers:
            self._drop(self._peers[name], "the KV sender said hello again")
        size = note.get("size")
        with self._nixl_lock:
            self._agent.add_remote_agent(metadata)
        peer = self._peers[name] = _NixlPeer(self, name)
        if note.get("mode") == "blocks":
            self._hello_blocks(peer, note)
            return
        if note.get("version") != WIRE_VERSION or not isinstance(size, int) or not 0 < size <= self.max_arena_bytes:
            error = (f"sender speaks wire version {note.get('version')}, this receiver {WIRE_VERSION}"
                     if note.get("version") != WIRE_VERSION else f"arena of {size} bytes refused (at most "
                     f"{self.max_arena_bytes})")  # fmt: skip
            peer.send(encode({"op": "error", "error": error}))
            self._drop(peer, error)
            return
        peer.arena = torch.zeros(size, dtype=torch.uint8)
        with self._nixl_lock:
            peer.registered = self._agent.register_memory(peer.arena)
        peer.view = memoryview(peer.arena.numpy())
        with self._nixl_lock:  # the sender needs the arena's registration: the metadata since it
            metadata = self._agent.get_agent_metadata()
        peer.send(encode({"op": "arena", "addr": peer.arena.data_ptr(), "size": size}) + b"\n" + metadata)

    def _hello_blocks(self, peer: _NixlPeer, note: dict) -> None:
        if note.get("version") != WIRE_VERSION:
            error = f"sender speaks wire version {note.get('version')}, this receiver {WIRE_VERSION}"
        elif self.blocks is None:
            error = "this KV receiver takes no direct block writes"
        else:
            error = self.blocks.refusal(note)
        if error:
            peer.send(encode({"op": "error", "error": error}))
            self._drop(peer, error)
            return
        peer.blocks = True
        with self._nixl_lock:  # with the cache's registration
            metadata = self._agent.get_agent_metadata()
        peer.send(encode({"op": "blocks", "region": self.blocks.region.to_json()}) + b"\n" + metadata)

    def _drop(self, peer: _NixlPeer, why: str, *, said_bye: bool = False) -> None:
        if self._peers.get(peer.name) is peer:
            del self._peers[peer.name]
        self._fail_peer(peer, why)
        if self.blocks is not None:
            self.blocks.forget_peer(peer, said_bye=said_bye)
        peer.close()
        _bury(peer.arena)
