"""Direct KV block writes over NIXL: the prefill worker's cache blocks go straight into the blocks the decode worker
reserved, by NIXL writes layer by layer, with no arena on either side (as vLLM's NIXL connector moves KV). Each
side registers its whole KV cache with its agent once; the one copy is the transport's. The arena transport of
:mod:`~common.kv_transfer.nixl` copies three times (tensor → staging → landing arena → cache) and stays the
fallback: for caches of different layouts (:class:`~common.kv_transfer.blocks.CacheLayout`) and for tensor
parallel engines (a rank holds a share of the heads), or with ``PDSERVE_NIXL_BLOCKS=0``.

The life cycle of a request:

1. ReserveKv: the decode worker offers the reservation's blocks (:meth:`NixlKVReceiver.offer_blocks`); their ids
   reach the prefill worker with the agent's metadata (``kv_block_ids`` of ReserveKvResponse and PrefillRequest).
2. The prefill worker's :class:`NixlBlockSender` (one per decode worker; it said ``hello`` with ``mode: blocks`` and
   its layout, the receiver answered ``blocks``: where its cache lies) sends ``claim`` (request id, block ids) as
   the request arrives. The receiver checks them against the offer and answers ``grant`` (``window_s``: what is
   left of the reservation's deadline) or ``failed``. From the grant on the blocks are the sender's to write: the
   receiver does not let them be freed (:meth:`NixlKVReceiver.writing`) until the sender says ``quiet``.
3. Per layer, as the engine computes it (:meth:`NixlBlockSender.send_blocks`, with the prefill cache's block ids):
   its checksum (:func:`~common.kv_transfer.blocks.layer_checksum`), then a WRITE of its (K|V, head, stretch of
   blocks) runs, whose note ``layers`` (layers, checksums) NIXL delivers once the bytes are there; the layers
   computed while the sender's thread was busy go in one WRITE. No write is posted after the sender's window
   (claim sent + ``window_s``, which ends before the receiver's deadline whatever the two clocks say).
4. Per layer noted the receiver sums its blocks the same way (while later layers are on their way): a mismatch
   ends the request FAILED ("checksum mismatch"); the last layer ends it DONE. It answers ``done`` / ``failed``.
5. A request that ends otherwise (deadline, abort on either side, a broken write): the sender posts nothing more
   for it and, once its posted writes completed, says ``quiet``; only then, or ``GRANT_GRACE_S`` after the
   reservation's deadline (a sender gone silent), may the decode worker free the blocks.

This module holds the prefill side (:class:`BlockEndpoint`, :class:`NixlBlockSender`); the decode side is
:class:`~common.kv_transfer.nixl_landing.BlockLanding`, inside :class:`~common.kv_transfer.nixl.NixlKVReceiver`
(whose :meth:`~common.kv_transfer.nixl.NixlKVReceiver.offer_blocks` and ``writing`` the decode servicer calls).

The prefill side's blocks stay the request's until ``finish`` returns (the prefill worker frees them after it):
the writes read them in place. Notes are JSON objects, like the arena protocol's.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from common.engine.kv_cache import PagedKVCache
from common.engine.omp_teams import run_serially
from common.kv_transfer.blocks import CacheLayout, CacheRegion, layer_checksum, on_stream, side_stream, write_descs
from common.kv_transfer.connector import TransferResult, TransferState
from common.kv_transfer.nixl import _AWAIT_POLL_S, _IDLE_POLL_S, _POLL_S, _new_agent, overdue
from common.kv_transfer.slots import _Transfer, encode
from common.kv_transfer.wire import WIRE_VERSION, encode_request_id

log = logging.getLogger(__name__)

BLOCKS_ENV = "PDSERVE_NIXL_BLOCKS"
CLOSE_WAIT_S = 1.0  # a closing sender waits this long for its posted writes


def blocks_enabled() -> bool:
    """Whether NIXL channels move blocks directly (``PDSERVE_NIXL_BLOCKS``, 0 or 1, default 1; ValueError else)."""
    value = os.environ.get(BLOCKS_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{BLOCKS_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


class BlocksRefused(ConnectionError):
    """The receiver takes no direct block writes from this sender (no cache offered, another layout): use the
    arena transport."""


# -- prefill side ----------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class _Outgoing(_Transfer):
    dst_ids: np.ndarray
    num_layers: int
    claim_sent_s: float
    write_until_s: float | None = None  # set by the grant (this process's clock)
    waiting: list[tuple[int, np.ndarray, object]] = field(default_factory=list)  # layers computed, not posted
    sums: dict[int, int] = field(default_factory=dict)  # layer -> checksum, of the layers posted
    handles: list = field(default_factory=list)  # posted WRITEs not yet complete
    sizes: list[int] = field(default_factory=list)  # their bytes, as handles
    posted_s: float = 0.0  # when the oldest of them was posted
    descs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # source ids, layer 0's local and remote descs
    told: bool = False  # quiet said (it failed, and nothing of it is in flight)
    forgotten: bool = False  # finish() returned: the record goes once nothing of it is in flight


class BlockEndpoint:
    """A prefill worker's side of block writes: one NIXL agent with the KV cache registered once, whatever the
    number of decode workers it writes to (an RDMA NIC pins and maps the cache once), shared by every
    :class:`NixlBlockSender`. Notifications are sorted per receiver (:meth:`notes`); one channel per receiver at a
    time (:meth:`attach` waits for a closing one to be gone, so its last notes precede the next one's hello)."""

    def __init__(self, kv_cache: PagedKVCache) -> None:
        self.cache = kv_cache
        self.layout = CacheLayout.of(kv_cache)
        self.region = CacheRegion.of(kv_cache)
        self.name, self.agent = _new_agent("send")
        self.lock = threading.Lock()  # one NIXL call at a time, from every channel's thread
        self._cond = threading.Condition()
        self._attached: set[str] = set()  # receivers with a channel open
        self._inbox: dict[str, list[bytes]] = {}
        self._loaded: dict[str, int] = {}  # receiver -> channels that loaded its metadata (open or closing)
        self.registered = self.agent.register_memory(kv_cache.data)

    def load(self, metadata: bytes) -> str:
        """Load a receiver's metadata (again: a later copy may carry registrations made since); its name."""
        with self.lock:
            name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        with self._cond:
            self._loaded[name] = self._loaded.get(name, 0) + 1
        return name

    def unload(self, receiver: str) -> None:
        """A channel that loaded ``receiver`` is gone: forget the receiver once no channel uses it."""
        with self._cond:
            self._loaded[receiver] -= 1
            if self._loaded[receiver]:
                return
            del self._loaded[receiver]
        with self.lock:
            try:
                self.agent.remove_remote_agent(receiver)
            except Exception:  # noqa: BLE001, S110
                pass

    def attach(self, receiver: str, timeout_s: float) -> None:
        """Reserve ``receiver`` for a new channel; ConnectionError if another is still open after ``timeout_s``."""
        with self._cond:
            if not self._cond.wait_for(lambda: receiver not in self._attached, timeout_s):
                raise ConnectionError(f"a NIXL KV block channel to {receiver} is still open")
            self._attached.add(receiver)
            self._inbox[receiver] = []

    def detach(self, receiver: str) -> None:
        with self._cond:
            self._attached.discard(receiver)
            self._inbox.pop(receiver, None)
            self._cond.notify_all()

    def notes(self, receiver: str) -> list[bytes]:
        """The notes that came from ``receiver`` since the last call (those of receivers not attached are dropped)."""
        with self.lock:
            got = self.agent.get_new_notifs()
        with self._cond:
            for peer, msgs in got.items():
                if peer in self._inbox:
                    self._inbox[peer].extend(msgs)
            if receiver not in self._inbox:
                return []
            mine, self._inbox[receiver] = self._inbox[receiver], []
            return mine

    def close(self) -> None:
        """After every channel closed (the prefill worker is stopping)."""
        with self.lock:
            if self.registered is not None:
                self.agent.deregister_memory(self.registered)  # the cache itself is the engine's
                self.registered = None


class NixlBlockSender:
    """Writes a prefill worker's KV blocks (``kv_cache``, registered with its own NIXL agent) straight into the
    blocks a :class:`~common.kv_transfer.nixl.NixlKVReceiver` reserved, per request (see the module doc).

    ``endpoint``: the worker's :class:`BlockEndpoint` (given a cache, the sender makes one of its own and closes it
    with itself). The constructor connects (at most ``connect_timeout_s``): raises :class:`BlocksRefused` when the
    receiver takes no blocks from this cache, ConnectionError when it does not answer; either leaves nothing
    behind. Verbs as
    :class:`~common.kv_transfer.connector.KVSender`'s, but a request starts with :meth:`claim` and sends its layers
    by block id (:meth:`send_blocks`), not as tensors. ``corrupt_next_layer`` is a TEST-ONLY switch: the next layer
    gets one byte of its first block flipped in the source cache after its checksum was taken. ``stall_s``: the
    lost-link watch (:data:`~common.kv_transfer.nixl.STALL_MIN_BYTES_PER_S`; 0: none): a receiver that stays silent
    while a grant, a write's completion or a confirmation is awaited breaks the channel.
    """

    def __init__(self, metadata: bytes, endpoint: BlockEndpoint | PagedKVCache, *,
                 connect_timeout_s: float = 5.0, stall_s: float = 0.0) -> None:  # fmt: skip
        self._stall_s = stall_s
        self._heard_s = time.monotonic()  # the receiver's last sign of life: a note, a write completed
        self._own_endpoint = isinstance(endpoint, PagedKVCache)
        self._endpoint = endpoint = BlockEndpoint(endpoint) if self._own_endpoint else endpoint
        self.layout, self.region, self.name = endpoint.layout, endpoint.region, endpoint.name
        self.corrupt_next_layer = False  # TEST ONLY
        self._cache = endpoint.cache
        self._agent, self._lock = endpoint.agent, endpoint.lock  # one NIXL call at a time
        self._cond = threading.Condition()  # guards the records below
        self._transfers: dict[str, _Outgoing] = {}
        self._broken = ""
        self._closed = False
        # from the engine: (request, layer, block ids, on CUDA the event recorded after the layer's kernels)
        self._layers: queue.SimpleQueue[tuple[str, int, np.ndarray, torch.cuda.Event | None]] = queue.SimpleQueue()
        self._stream = side_stream(self._cache)  # the checksums' (CUDA)
        self._wake = threading.Event()
        self.receiver = None
        self._loaded = self._attached = False
        try:
            self.receiver = endpoint.load(metadata)
            self._loaded = True
            endpoint.attach(self.receiver, timeout_s=connect_timeout_s)
            self._attached = True
            self.remote = self._connect(connect_timeout_s)
        except Exception as e:
            self._release()
            if isinstance(e, BlocksRefused):
                raise
            raise ConnectionError(f"cannot open a NIXL KV block channel: {e}") from e
        self.address = self.receiver
        self._thread = threading.Thread(target=self._loop, name="nixl-kv-blocks", daemon=True)
        self._thread.start()

    def _connect(self, timeout_s: float) -> CacheRegion:
        hello = encode({"op": "hello", "version": WIRE_VERSION, "mode": "blocks", "layout": self.layout.to_json()})
        with self._lock:
            self._agent.send_notif(self.receiver, hello + b"\n" + self._agent.get_agent_metadata())
        until = time.monotonic() + timeout_s
        while time.monotonic() < until:
            for msg in self._endpoint.notes(self.receiver):
                head, _, metadata = msg.partition(b"\n")
                reply = json.loads(head)
                if reply.get("op") == "blocks":
                    with self._lock:
                        self._agent.add_remote_agent(metadata)  # with the cache's registration
                    return CacheRegion.from_json(reply["region"])
                if reply.get("op") == "error":
                    raise BlocksRefused(f"the KV receiver takes no blocks from this sender: {reply.get('error')}")
            time.sleep(_POLL_S * 5)
        raise ConnectionError(f"no answer from NIXL KV receiver {self.receiver} within {timeout_s}s")

    @property
    def broken(self) -> str:
        """Why the channel is unusable ('' while it works)."""
        with self._cond:
            return self._broken

    # -- the verbs ----------------------------------------------------------------------------------------------

    def claim(self, request_id: str, dst_block_ids: list[int], num_layers: int) -> None:
        """Start ``request_id``: ask for the receiver's blocks ``dst_block_ids`` (as offered at ReserveKv). Never
        blocks; the answer comes later. ValueError for bad arguments, RuntimeError once closed."""
        encode_request_id(request_id)
        if not dst_block_ids or num_layers != self.layout.num_layers:
            raise ValueError(f"a claim needs block ids and {self.layout.num_layers} layers, got "
                             f"{len(dst_block_ids)} blocks, {num_layers} layers")  # fmt: skip
        dst = np.asarray(dst_block_ids, np.int64)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"KV sender to {self.receiver!r} is closed")
            if request_id in self._transfers:
                raise ValueError(f"request {request_id!r} is already claimed")
            now = time.monotonic()
            self._transfers[request_id] = _Outgoing(now, dst_ids=dst, num_layers=num_layers, claim_sent_s=now)
            broken = self._broken
        if broken:
            self._fail(request_id, broken)
            return
        self._send({"op": "claim", "request_id": request_id, "blocks": dst.tolist()})
        self._wake.set()  # polls soon for the grant

    def send_blocks(self, request_id: str, layer: int, src_block_ids: list[int]) -> None:
        """Queue layer ``layer`` of ``request_id``, held in blocks ``src_block_ids`` of this side's cache (which must
        not change until :meth:`finish` returns). Called by the engine thread as the layer is computed; never
        blocks; dropped for a request not claimed or already ended. On CUDA the layer's kernels may not have run
        yet: an event recorded here on the caller's stream is waited for before the blocks are read (a NIXL
        write goes around CUDA's streams)."""
        ready = None
        if self._cache.data.is_cuda:  # the cache's device's stream (the thread's current device may be another)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._cache.data.device))
        self._layers.put((request_id, layer, np.asarray(src_block_ids, np.int64), ready))
        self._wake.set()

    def finish(self, request_id: str, timeout_s: float) -> TransferResult:
        """As :meth:`KVSender.finish`: DONE once the receiver checked every layer, else FAILED naming why (after a
        timeout the request is aborted on both sides first)."""
        until = time.monotonic() + timeout_s
        with self._cond:
            transfer = self._transfers.get(request_id)
            if transfer is None or transfer.forgotten:
                return TransferResult(TransferState.FAILED, 0, 0.0, f"unknown request {request_id!r}")
            while not transfer.state.is_terminal and (left_s := until - time.monotonic()) > 0:
                self._cond.wait(left_s)
            timed_out = transfer.end(TransferState.FAILED, f"KV of request {request_id!r} not confirmed within "
                                     f"{timeout_s}s ({len(transfer.sums)} of {transfer.num_layers} layers written)")
            transfer.forgotten = True
        if timed_out:
            self._send({"op": "abort", "request_id": request_id})
        self._wake.set()
        return transfer.result()

    def poll(self, request_id: str) -> TransferState:
        with self._cond:
            transfer = self._transfers.get(request_id)
            return TransferState.FAILED if transfer is None or transfer.forgotten else transfer.state

    def abort(self, request_id: str) -> None:
        """End ``request_id`` FAILED and tell the receiver; idempotent; never blocks."""
        if self._fail(request_id, f"request {request_id!r} aborted by sender"):
            self._send({"op": "abort", "request_id": request_id})

    def close(self) -> None:
        """Fail what is unfinished, wait up to CLOSE_WAIT_S for posted writes, say bye (if none is left) and go."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._fail_all(f"KV sender to {self.receiver!r} closed")
        self._wake.set()
        self._thread.join()
        with self._cond:
            in_flight = any(t.handles for t in self._transfers.values())
        if not in_flight:  # a bye tells the receiver that nothing of ours is on its way any more
            self._send({"op": "bye"})
        self._release()

    # -- internals ----------------------------------------------------------------------------------------------

    def _send(self, msg: dict) -> None:
        try:
            with self._lock:
                self._agent.send_notif(self.receiver, encode(msg))
        except Exception as e:  # noqa: BLE001  (NIXL raises its own types)
            self._on_broken(f"lost the NIXL channel to KV receiver {self.receiver}: {e!r}")

    def _fail(self, request_id: str, error: str) -> bool:
        with self._cond:
            transfer = self._transfers.get(request_id)
            if transfer is None or not transfer.end(TransferState.FAILED, error):
                return False
            self._cond.notify_all()
        self._wake.set()
        return True

    def _fail_all(self, error: str) -> None:
        for transfer in self._transfers.values():
            transfer.end(TransferState.FAILED, error)
        self._cond.notify_all()

    def _on_broken(self, error: str) -> None:
        with self._cond:
            self._broken = self._broken or error
            self._fail_all(self._broken)

    def _release(self) -> None:
        if self._attached:
            self._endpoint.detach(self.receiver)
            self._attached = False
        if self._loaded:
            self._endpoint.unload(self.receiver)
            self._loaded = False
        if self._own_endpoint:
            self._endpoint.close()

    # -- the I/O thread -----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        run_serially()  # checksums beside the engine's step: no OpenMP team of its own
        closing_until = None
        while True:
            while True:
                try:
                    request_id, layer, src, ready = self._layers.get_nowait()
                except queue.Empty:
                    break
                self._take_layer(request_id, layer, src, ready)
            for msg in self._endpoint.notes(self.receiver):
                self._on_note(msg)
            self._post_waiting()
            self._check_writes()
            self._check_silence()
            poll_s = self._tell()
            with self._cond:
                closed, writing = self._closed, any(t.handles for t in self._transfers.values())
            if closed:
                closing_until = closing_until or time.monotonic() + CLOSE_WAIT_S
                if not writing or time.monotonic() > closing_until:
                    return
            self._wake.wait(poll_s)
            self._wake.clear()

    def _take_layer(self, request_id: str, layer: int, src: np.ndarray, ready: torch.cuda.Event | None) -> None:
        with self._cond:
            transfer = self._transfers.get(request_id)
            if transfer is None or transfer.state.is_terminal:
                return
            taken = layer in transfer.sums or any(layer == w for w, _, _ in transfer.waiting)
            if len(src) != len(transfer.dst_ids) or not 0 <= layer < transfer.num_layers or taken:
                error = (f"layer {layer} of {len(src)} blocks does not fit the claim ({transfer.num_layers} layers of "
                         f"{len(transfer.dst_ids)} blocks, each once)")  # fmt: skip
                transfer.end(TransferState.FAILED, error)
                self._cond.notify_all()
                return
            transfer.waiting.append((layer, src, ready))

    def _post_waiting(self) -> None:
        """Post the layers waiting in granted requests: one WRITE per request for all of its layers computed since
        the last one (this thread only)."""
        with self._cond:
            ready = [(rid, t) for rid, t in self._transfers.items()
                     if t.waiting and t.write_until_s is not None and not t.state.is_terminal]  # fmt: skip
        for request_id, transfer in ready:
            with self._cond:
                layers, transfer.waiting = transfer.waiting, []
            self._post(request_id, transfer, layers)

    def _post(self, request_id: str, transfer: _Outgoing,
              layers: list[tuple[int, np.ndarray, torch.cuda.Event | None]]) -> None:  # fmt: skip
        """Checksums, then one WRITE of the layers' runs, whose note NIXL delivers after the bytes."""
        if time.monotonic() >= transfer.write_until_s:
            self._fail(request_id, f"the decode worker's KV deadline for request {request_id!r} passed before layer "
                                   f"{layers[0][0]} was sent")  # fmt: skip
            return
        sums, local, remote = [], [], []
        for layer, src, ready in layers:
            if ready is not None:
                ready.synchronize()  # the layer's KV is in the cache
            with on_stream(self._stream):
                sums.append(layer_checksum(self._cache, layer, src))
            if self.corrupt_next_layer:  # TEST ONLY fault injection
                self.corrupt_next_layer = False
                first = self._cache.data[layer, 0, 0, int(src[0])].reshape(-1)[:1].view(torch.uint8)  # [elem bytes]
                first[0] = first[0] ^ 0xFF
            if transfer.descs is None or not np.array_equal(transfer.descs[0], src):  # the same for every layer
                transfer.descs = (src, *write_descs(self.layout, 0, self.region, src, self.remote, transfer.dst_ids))
            local.append(transfer.descs[1].copy())
            local[-1][:, 0] += np.uint64(layer * self.layout.layer_bytes(self.region.num_blocks))
            remote.append(transfer.descs[2].copy())
            remote[-1][:, 0] += np.uint64(layer * self.layout.layer_bytes(self.remote.num_blocks))
        numbers = [layer for layer, _, _ in layers]
        note = encode({"op": "layers", "request_id": request_id, "layers": numbers, "sums": sums})
        try:
            with self._lock:
                handle = self._agent.initialize_xfer(
                    "WRITE",
                    self._agent.get_xfer_descs(np.concatenate(local), self.region.mem_type),
                    self._agent.get_xfer_descs(np.concatenate(remote), self.remote.mem_type),
                    self.receiver,
                    note,  # delivered once the layers' bytes are there
                )
                state = self._agent.transfer(handle)
        except Exception as e:  # noqa: BLE001
            self._on_broken(f"NIXL write to KV receiver {self.receiver} failed: {e!r}")
            return
        with self._cond:
            transfer.sums.update(zip(numbers, sums, strict=True))
            if not transfer.handles:
                transfer.posted_s = time.monotonic()
            transfer.handles.append(handle)
            transfer.sizes.append(int(sum(int(d[:, 1].sum()) for d in local)))
            if transfer.state is TransferState.PENDING:
                transfer.state = TransferState.TRANSFERRING
        if state == "ERR":
            self._on_broken(f"NIXL write to KV receiver {self.receiver} failed")

    def _on_note(self, msg: bytes) -> None:
        self._heard_s = time.monotonic()
        try:
            note = json.loads(msg)
            op = note["op"]
            if op == "dropped":
                self._on_broken(note.get("error") or f"KV receiver {self.receiver} dropped the channel")
                return
            with self._cond:
                transfer = self._transfers.get(note["request_id"])
            if transfer is None:
                return
            if op == "grant":
                self._granted(transfer, float(note["window_s"]))
            elif op == "done":
                with self._cond:
                    if transfer.end(TransferState.DONE):
                        transfer.num_bytes = transfer.num_layers * self.layout.layer_bytes(len(transfer.dst_ids))
                    self._cond.notify_all()
            elif op == "failed":
                self._fail(note["request_id"], note.get("error") or "the KV receiver failed the request")
            else:
                raise ValueError(f"unexpected message {op!r}")
        except (ValueError, KeyError, TypeError) as e:
            self._on_broken(f"protocol error from KV receiver {self.receiver}: {e!r} in {msg[:200]!r}")

    def _granted(self, transfer: _Outgoing, window_s: float) -> None:
        with self._cond:
            transfer.write_until_s = transfer.claim_sent_s + window_s

    def _check_writes(self) -> None:
        with self._cond:
            pending = [(t, h) for t in self._transfers.values() for h in t.handles]
        failed = False
        for transfer, handle in pending:
            with self._lock:
                state = self._agent.check_xfer_state(handle)
                if state in ("DONE", "ERR"):
                    self._agent.release_xfer_handle(handle)
            if state in ("DONE", "ERR"):
                failed |= state == "ERR"
                self._heard_s = time.monotonic()
                with self._cond:
                    del transfer.sizes[transfer.handles.index(handle)]
                    transfer.handles.remove(handle)
        if failed:
            self._on_broken(f"a NIXL write to KV receiver {self.receiver} failed")

    def _check_silence(self) -> None:
        """Break the channel when the receiver stays silent past the stall allowance while something of it is
        awaited: a grant, a posted write's completion, the confirmation of a request whose layers all went (not a
        granted request whose layers the engine is still computing)."""
        now = time.monotonic()
        late = ""
        with self._cond:
            if self._broken:
                return
            for request_id, t in self._transfers.items():
                if t.state.is_terminal:
                    continue
                if t.write_until_s is None:
                    since_s, outstanding, what = t.claim_sent_s, 0, "its grant"
                elif t.handles:
                    since_s, outstanding, what = t.posted_s, sum(t.sizes), f"{len(t.handles)} writes"
                elif len(t.sums) == t.num_layers:
                    since_s, outstanding, what = 0.0, 0, "its confirmation"
                else:
                    continue  # layers still to come from the engine
                since_s = max(since_s, self._heard_s)
                if overdue(self._stall_s, since_s, outstanding, now):
                    late = (f"KV receiver {self.receiver} silent for {now - since_s:.1f}s while request {request_id!r} "
                            f"awaited {what} (--kv-write-stall-s {self._stall_s:g}): its link is lost")
                    break
        if late:
            self._on_broken(late)

    def _tell(self) -> float:
        """Say ``quiet`` for requests that failed once their writes completed; forget what finish() returned and
        nothing is left of. Returns how soon to look again: soon while writes or grants are awaited, less soon
        while granted requests wait for their layers."""
        notes, poll_s = [], _IDLE_POLL_S
        with self._cond:
            for request_id, t in list(self._transfers.items()):
                if t.handles or (t.write_until_s is None and not t.state.is_terminal):
                    poll_s = _POLL_S
                    continue
                if not t.told and t.state is TransferState.FAILED:
                    t.told = True
                    notes.append({"op": "quiet", "request_id": request_id})
                if t.forgotten and t.state.is_terminal and (t.told or t.state is TransferState.DONE):
                    del self._transfers[request_id]
                elif not t.state.is_terminal:
                    poll_s = min(poll_s, _AWAIT_POLL_S)
        for note in notes:
            self._send(note)
        return poll_s
