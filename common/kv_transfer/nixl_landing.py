"""The decode side of direct KV block writes over NIXL (the protocol: :mod:`~common.kv_transfer.nixl_blocks`): the
decode engine's KV cache registered with a :class:`~common.kv_transfer.nixl.NixlKVReceiver`'s agent, the
reservations offered to block senders, the grants made to them, and each layer's checksum checked as it lands."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from common.engine.kv_cache import PagedKVCache
from common.kv_transfer.blocks import CacheLayout, CacheRegion, layer_checksum, on_stream, side_stream
from common.kv_transfer.connector import TransferState
from common.kv_transfer.slots import encode, failed_msg

GRANT_GRACE_S = 10.0  # past a reservation's deadline, a granted sender that never said quiet no longer holds it


@dataclass
class _Grant:
    request_id: str
    peer: object  # the _NixlPeer whose writes may land in the blocks
    until_s: float  # time.monotonic(): the blocks are free to go after this, quiet or not
    layers: set[int] = field(default_factory=set)  # layers landed and checked


class BlockLanding:
    """The decode side of direct block writes, owned by a :class:`~common.kv_transfer.nixl.NixlKVReceiver`: its KV
    cache registered with the receiver's agent, the reservations offered (:meth:`offer`) and the grants made.

    The receiver's I/O thread calls :meth:`hello`, :meth:`on_claim`, :meth:`on_layer`, :meth:`on_quiet`,
    :meth:`forget_peer` and :meth:`expire`; the decode servicer :meth:`offer` and :meth:`writing`."""

    def __init__(self, receiver, kv_cache: PagedKVCache, on_bytes: Callable[[int], None] | None = None) -> None:
        self.receiver = receiver
        self.on_bytes = on_bytes
        self.cache = kv_cache
        self.layout = CacheLayout.of(kv_cache)
        self.region = CacheRegion.of(kv_cache)
        self._stream = side_stream(kv_cache)  # the checksums' (CUDA): not behind the engine's decode steps
        with receiver._nixl_lock:
            self.registered = receiver._agent.register_memory(kv_cache.data)
        self._lock = threading.Lock()
        self._offers: dict[str, np.ndarray] = {}  # request id -> the reservation's block ids
        self._grants: dict[str, _Grant] = {}  # by request id, or by the key hold() gave
        self._num_held = 0

    def offer(self, request_id: str, block_ids: list[int]) -> None:
        """Let a sender claim the reservation of ``request_id`` (already expected by the receiver), whose blocks
        are ``block_ids``."""
        with self._lock:
            self._offers[request_id] = np.asarray(block_ids, np.int64)

    def writing(self, request_id: str) -> bool:
        """Whether a sender's writes may still land in the request's blocks (``request_id``, or the key
        :meth:`hold` gave them): they must not be freed yet."""
        with self._lock:
            grant = self._grants.get(request_id)
            return grant is not None and time.monotonic() < grant.until_s

    def hold(self, request_id: str) -> str | None:
        """The request ended here while its sender may still write: its grant moves to a key of its own (returned;
        None when there is no grant), so the request id is free for a retry, whose claim gets a grant of its own.
        The sender's quiet still ends it."""
        with self._lock:
            grant = self._grants.pop(request_id, None)
            if grant is None:
                return None
            self._num_held += 1
            key = f"{request_id}#held-{self._num_held}"
            self._grants[key] = grant
            return key

    # -- for the receiver's I/O thread ----------------------------------------------------------------------------

    def refusal(self, note: dict) -> str:
        """Why a sender's ``hello`` in mode blocks cannot be served ('' when its layout is this cache's)."""
        try:
            theirs = CacheLayout.from_json(note["layout"])
        except (KeyError, TypeError, ValueError) as e:
            return f"bad layout in hello: {e!r}"
        return "" if theirs == self.layout else f"sender's cache layout {theirs} differs from {self.layout}"

    def on_claim(self, peer, request_id: str, block_ids: list[int]) -> None:
        receiver = self.receiver
        with receiver._cond:
            entry = receiver._expected.get(request_id)
        with self._lock:
            offered = self._offers.get(request_id)
        error = ""
        if entry is None or offered is None:
            error = f"no KV reservation for request {request_id!r} (never made, aborted, or already received)"
        elif not np.array_equal(np.asarray(block_ids, np.int64), offered):
            error = f"blocks claimed for request {request_id!r} are not the ones reserved"
        if error:
            peer.send(failed_msg(request_id, error))
            return
        with entry.feed_lock:
            now = time.monotonic()
            if entry.state.is_terminal or now >= entry.deadline_at_s or entry.peer is not None:
                error = entry.error or (f"KV of request {request_id!r} was already claimed" if entry.peer is not None
                                        else f"the KV deadline of request {request_id!r} passed")  # fmt: skip
            else:
                entry.peer = peer
                with receiver._cond:
                    entry.state = TransferState.TRANSFERRING
                with self._lock:
                    self._grants[request_id] = _Grant(request_id, peer, entry.deadline_at_s + GRANT_GRACE_S)
        if error:
            peer.send(failed_msg(request_id, error))
        else:
            peer.send(encode({"op": "grant", "request_id": request_id, "window_s": entry.deadline_at_s - now}))

    def on_layer(self, peer, request_id: str, layer: int, checksum: int) -> None:
        """A layer's bytes landed (NIXL delivers a write's note after its data): check them against the sender's
        checksum; the last layer ends the request DONE, and the sender's writes with it."""
        receiver = self.receiver
        with self._lock:
            grant = self._grants.get(request_id)
            if grant is None or grant.peer is not peer:
                return  # not this sender's (it was told when its claim failed)
            offered = self._offers.get(request_id)
        with receiver._cond:
            entry = receiver._expected.get(request_id)
        if entry is None or offered is None:
            return  # aborted here: the grant stays until the sender's quiet
        with entry.feed_lock:
            if entry.state.is_terminal:
                return
            if not 0 <= layer < self.layout.num_layers or layer in grant.layers:
                error = f"KV of request {request_id!r}: layer {layer} written twice or out of range"
                receiver._end(request_id, entry, TransferState.FAILED, error)
                return
            with on_stream(self._stream):
                landed = layer_checksum(self.cache, layer, offered)
            if landed != checksum:
                error = f"KV of request {request_id!r}: checksum mismatch in layer {layer} after its NIXL write"
                receiver._end(request_id, entry, TransferState.FAILED, error)
                return
            grant.layers.add(layer)
            layer_bytes = self.layout.layer_bytes(len(offered))
            with receiver._cond:
                entry.num_bytes += layer_bytes
            if len(grant.layers) < self.layout.num_layers:
                return
            with self._lock:  # every write of the request landed: nothing of the sender's is on its way any more
                self._grants.pop(request_id, None)
                self._offers.pop(request_id, None)
            receiver._end(request_id, entry, TransferState.DONE)
        if self.on_bytes is not None:
            self.on_bytes(self.layout.num_layers * layer_bytes)

    def on_quiet(self, peer, request_id: str) -> None:
        with self._lock:
            for key in [k for k, g in self._grants.items() if g.request_id == request_id and g.peer is peer]:
                del self._grants[key]

    def forget_peer(self, peer, *, said_bye: bool) -> None:
        """A sender went: after its bye (its writes completed) its grants end; a sender dropped otherwise may
        still have writes on their way, so its grants run until their time."""
        if said_bye:
            with self._lock:
                for request_id in [r for r, g in self._grants.items() if g.peer is peer]:
                    del self._grants[request_id]

    def expire(self) -> None:
        """Forget offers of requests the receiver no longer expects and grants past their time."""
        receiver = self.receiver
        with receiver._cond:
            expected = set(receiver._expected)
        now = time.monotonic()
        with self._lock:
            for request_id in [r for r in self._offers if r not in expected]:
                del self._offers[request_id]
            for request_id in [r for r, g in self._grants.items() if now >= g.until_s]:
                del self._grants[request_id]

    def close(self) -> None:
        receiver = self.receiver
        with receiver._nixl_lock:
            if self.registered is not None:
                receiver._agent.deregister_memory(self.registered)
                self.registered = None
