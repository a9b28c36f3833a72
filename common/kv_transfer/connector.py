"""The KV connector: how a prefill worker's KV reaches a decode worker, whatever carries the bytes.

Two roles, one per process, tied together by :class:`TransferState` (PENDING → TRANSFERRING → DONE |
FAILED) and by the chunks of :mod:`common.kv_transfer.wire`, which every transport carries unchanged.

The life cycle of a request's KV:

1. decode reserves blocks, then calls :meth:`KVReceiver.expect` (with a ``write`` that lands chunks in
   those blocks) *before* it tells the router that prefill may start;
2. prefill calls :meth:`KVSender.send_layer` as each layer is computed; the transport encodes chunks,
   moves them and the receiver checks each one (checksum, shape, block range) and ``write``\\ s it;
3. once every layer's blocks arrived, the receiver reports DONE to both sides: prefill's
   :meth:`KVSender.finish` and decode's :meth:`KVReceiver.wait` / :meth:`KVReceiver.poll` return it;
4. anything else (a corrupt, duplicate or misplaced chunk, a lost peer, a deadline or timeout, an
   abort) ends the request FAILED on both sides with an error that names the cause; each side then frees
   what it holds (prefill its copies, decode its reserved blocks) and the caller may retry once.

Methods by the process that calls them:

Prefill worker (:class:`KVSender`, one per decode peer)
    - :meth:`~KVSender.send_layer`: engine compute thread, once per (request, layer); never blocks.
    - :meth:`~KVSender.finish`: worker's request thread, once per request after its last layer; blocks
      at most ``timeout_s``.
    - :meth:`~KVSender.poll`: any thread; never blocks.
    - :meth:`~KVSender.abort`: any thread; idempotent; never blocks.
    - :meth:`~KVSender.close`: the owner, once at shutdown; idempotent.

Decode worker (:class:`KVReceiver`, one per worker, serving every prefill peer)
    - :meth:`~KVReceiver.expect`: worker's reservation handler, once per request; never blocks.
    - :meth:`~KVReceiver.wait`: worker's request thread; blocks until DONE, FAILED, the deadline given to
      ``expect``, or ``timeout_s``, whichever comes first.
    - :meth:`~KVReceiver.poll`: the decode loop, to admit requests whose KV arrived; never blocks.
    - :meth:`~KVReceiver.abort`: any thread; idempotent; returns once ``write`` will not be called again.
    - :meth:`~KVReceiver.close`: the owner, once at shutdown; idempotent.

``write`` (given to ``expect``) runs on the receiver's transport thread: it must only touch the
request's own reserved blocks (as :meth:`~common.engine.disagg.KVHandoffMixin.write_kv` does) and copy
``k``/``v`` out before returning. Transports: :mod:`common.kv_transfer.shm` (same host),
:mod:`common.kv_transfer.nixl` (any host); gRPC carries the same chunk bytes inside a bytes field of a streaming
RPC. :mod:`common.kv_transfer.nixl_blocks` moves blocks without chunks or ``write``: its sender writes into the
reserved blocks itself, so there the blocks may be freed only once ``NixlKVReceiver.writing`` is False as well.
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from common.engine.kv_cache import KVCacheSpec
from common.kv_transfer.wire import WriteFn


class TransferState(enum.Enum):
    PENDING = "pending"  # known (expected / first layer queued), no chunk moved yet
    TRANSFERRING = "transferring"  # at least one chunk moved
    DONE = "done"  # every block of every layer arrived and was written (terminal)
    FAILED = "failed"  # terminal; TransferResult.error says why

    @property
    def is_terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


@dataclass(frozen=True)
class TransferResult:
    """What one side saw of one request's transfer.

    ``state`` is DONE or FAILED when the transfer ended; ``wait`` returns PENDING or TRANSFERRING only when
    its own ``timeout_s`` ran out first. ``error`` is empty exactly when ``state`` is not FAILED.
    """

    state: TransferState
    num_bytes: int  # payload bytes acknowledged (sender) / written (receiver) so far
    seconds: float  # since the first send_layer (sender) / since expect (receiver)
    error: str = ""

    def __post_init__(self) -> None:
        if (self.state is TransferState.FAILED) != bool(self.error):
            raise ValueError(f"a {self.state.value} transfer result with error {self.error!r}")

    @property
    def ok(self) -> bool:
        return self.state is TransferState.DONE


class KVSender(ABC):
    """Prefill side: moves one request's KV, layer by layer, to the decode worker that reserved it."""

    @abstractmethod
    def send_layer(self, request_id: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Queue one layer's KV blocks ``k``/``v`` ``[num_blocks, block_size, num_kv_heads, head_dim]``.

        Called by the prefill engine's compute thread right after layer ``layer`` is computed (the
        signature of the engine's ``kv_layer_sink``). Must not block: it only enqueues. The sender takes
        ownership of ``k`` and ``v`` (copies, as ``read_blocks`` makes them): the caller must not change them.
        The first call for a request starts its transfer (PENDING). Not idempotent: each layer once.

        Failure: raises ValueError for bad arguments (shape, dtype, request id) and RuntimeError once
        closed; transport failures are never raised here, :meth:`finish` reports them. A call for a request
        that was aborted or already failed is dropped silently.
        """

    @abstractmethod
    def finish(self, request_id: str, timeout_s: float) -> TransferResult:
        """Wait until the receiver confirms every layer of ``request_id`` arrived; then forget the request.

        Called once per request, by the prefill worker after its last :meth:`send_layer` (also after an
        abort, to forget it). Blocks at most ``timeout_s`` (plus scheduling noise), never hangs. Returns
        DONE, or FAILED with the receiver's error (checksum, deadline, no reservation...), the transport's
        (peer gone) or a timeout; on timeout the sender aborts the request on both sides first. For a
        request it does not know, returns FAILED naming it. Not idempotent: a second call finds nothing.
        """

    @abstractmethod
    def poll(self, request_id: str) -> TransferState:
        """The request's state now; never blocks; FAILED for a request the sender does not know."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop sending ``request_id``: queued layers are dropped and the receiver is told (best effort).

        Any thread; never blocks; idempotent, and a no-op for unknown requests. The request ends FAILED;
        :meth:`finish` still has to be called to forget it. Chunks already handed to the transport are
        reclaimed when the receiver acknowledges them, or at :meth:`close`.
        """

    @abstractmethod
    def close(self) -> None:
        """Fail every unfinished request, stop the transport's threads and free its resources.

        Called once by the owner at shutdown; idempotent; may block briefly (joins threads). After it,
        :meth:`send_layer` raises and :meth:`finish` returns FAILED.
        """


class KVReceiver(ABC):
    """Decode side: lands the KV of requests it reserved blocks for, from any prefill peer."""

    @abstractmethod
    def expect(
        self,
        request_id: str,
        num_layers: int,
        num_blocks: int,
        spec: KVCacheSpec,
        write: WriteFn,
        deadline_s: float,
    ) -> None:
        """Register a reservation: blocks ``[0, num_blocks)`` of layers ``[0, num_layers)`` will arrive.

        Called by the decode worker once per request, after reserving blocks and before prefill may send.
        Never blocks. ``write(layer, first_block, k, v)`` is called on the transport thread for each
        checked chunk (``k``/``v`` ``[n, spec.block_size, spec.num_kv_heads, spec.head_dim]`` of
        ``spec.dtype``, valid only during the call). ``deadline_s``: seconds from now by which everything
        must have arrived; after it the request is FAILED (keep it shorter than the blocks' lease).

        Failure: ValueError if ``request_id`` is already expected or the sizes are not positive;
        RuntimeError once closed.
        """

    @abstractmethod
    def wait(self, request_id: str, timeout_s: float) -> TransferResult:
        """Block until the request is DONE or FAILED, its deadline passes, or ``timeout_s`` runs out.

        Called by the decode worker's request thread. Returns at the earliest of those (never hangs):
        DONE or FAILED (a passed deadline is FAILED, naming the missing blocks) end the request and the
        receiver forgets it; PENDING / TRANSFERRING (only when ``timeout_s`` ran out first) keep it, so
        ``wait`` may be called again. For a request it does not know, returns FAILED naming it. Once it
        returns FAILED, ``write`` is never called again for the request: its blocks may be freed.
        """

    @abstractmethod
    def poll(self, request_id: str) -> TransferState:
        """The request's state now (FAILED once its deadline passed); never blocks; FAILED if unknown.

        Does not forget the request: call :meth:`wait` (returns at once when terminal) or :meth:`abort`.
        """

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Give up on ``request_id``: ends it FAILED, tells its sender (best effort), forgets it.

        Any thread; idempotent, a no-op for unknown requests. May block for the duration of one
        ``write`` already running: once it returns, ``write`` is never called again for this request, so
        the caller may free the reserved blocks.
        """

    @abstractmethod
    def close(self) -> None:
        """Fail every pending request, stop the transport and free its resources (idempotent)."""


class SenderPool:
    """A prefill worker's open channels to decode workers, one per (transport, endpoint), opened on first use.

    Decode workers come and go (autoscaling, restarts) and a channel holds an arena (64 MiB by default): a channel
    whose transport broke (``sender.broken``) or that carried no request for ``idle_s`` is closed when the pool
    is next used (on a thread of its own: closing may wait briefly for unfinished writes). ``idle_s`` must exceed
    the longest transfer; a request's channel is marked used when it is taken. A channel is opened outside the
    pool's lock, once: requests for the same key wait for that opening, others go on (opening a channel to a
    host that does not answer takes seconds).
    """

    def __init__(self, idle_s: float = 600.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._senders: dict[Hashable, tuple[KVSender, float]] = {}  # key -> (sender, last used)
        self._opening: dict[Hashable, concurrent.futures.Future] = {}  # key -> its sender or exception, once open

    def get(self, key: Hashable, open_sender: Callable[[], KVSender]) -> KVSender:
        """The channel for ``key``, opened by ``open_sender()`` if there is none (its exceptions propagate, to the
        requests that waited for the same opening too)."""
        now = self._clock()
        with self._lock:
            stale = [k for k, (s, used) in self._senders.items()
                     if getattr(s, "broken", "") or now - used > self.idle_s]  # fmt: skip
            dropped = [self._senders.pop(k)[0] for k in stale]
            entry = self._senders.get(key)
            if entry is not None:
                self._senders[key] = (entry[0], now)
            opening = self._opening.get(key) if entry is None else None
            mine = entry is None and opening is None
            if mine:
                opening = self._opening[key] = concurrent.futures.Future()
        for old in dropped:
            threading.Thread(target=old.close, name="kv-channel-close", daemon=True).start()
        if entry is not None:
            return entry[0]
        if not mine:
            return opening.result()  # another request is opening it: its outcome
        try:
            sender = open_sender()
        except BaseException as exc:
            with self._lock:
                del self._opening[key]
            opening.set_exception(exc)
            raise
        with self._lock:
            del self._opening[key]
            self._senders[key] = (sender, self._clock())
        opening.set_result(sender)
        return sender

    def __len__(self) -> int:
        with self._lock:
            return len(self._senders)

    def close(self) -> None:
        """Close every channel (the worker is stopping)."""
        with self._lock:
            senders = [s for s, _ in self._senders.values()]
            self._senders.clear()
        for sender in senders:
            sender.close()
