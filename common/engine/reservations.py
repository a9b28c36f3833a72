"""KV blocks reserved, under a lease, for requests whose KV is computed by another engine.

The decode side of the disaggregated hand-off: the router asks a decode engine to reserve blocks for a
request *before* prefill starts; the prefill engine then writes the prompt's KV into them layer by layer;
finally the request is admitted to the decode batch and the blocks become its own. A reservation that is
neither admitted nor released before its lease ends is freed by :meth:`ReservationTable.expire`, so a
transfer that never completes cannot leak blocks.

Not thread-safe: the engine's owner serializes calls (as for the engine itself).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from common.engine.block_pool import BlockPool


@dataclass
class Reservation:
    request_id: str
    block_ids: list[int]
    num_tokens: int  # tokens whose KV will arrive: positions [0, num_tokens)
    expires_at_s: float  # on the table's clock (monotonic seconds)


class ReservationTable:
    def __init__(self, block_pool: BlockPool, block_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self._clock = clock
        self._reservations: dict[str, Reservation] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reservations

    def __len__(self) -> int:
        return len(self._reservations)

    @property
    def num_reserved_blocks(self) -> int:
        return sum(len(r.block_ids) for r in self._reservations.values())

    def reserve(self, request_id: str, num_tokens: int, lease_s: float) -> Reservation:
        """Allocate the blocks for ``num_tokens`` tokens; raises NoFreeBlocksError (nothing taken) if short."""
        if request_id in self._reservations:
            raise ValueError(f"request {request_id!r} already has a KV reservation")
        if num_tokens < 1:
            raise ValueError(f"a KV reservation needs at least 1 token, got {num_tokens}")
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        blocks = self.block_pool.allocate(-(-num_tokens // self.block_size))
        reservation = Reservation(request_id, blocks, num_tokens, self._clock() + lease_s)
        self._reservations[request_id] = reservation
        return reservation

    def get(self, request_id: str) -> Reservation:
        reservation = self._reservations.get(request_id)
        if reservation is None:
            raise ValueError(f"request {request_id!r} has no KV reservation (never made, expired or released)")
        return reservation

    def take(self, request_id: str) -> Reservation:
        """Remove a reservation without freeing its blocks: their ownership moves to the caller."""
        reservation = self.get(request_id)
        del self._reservations[request_id]
        return reservation

    def rename(self, request_id: str, new_id: str) -> bool:
        """Move a reservation (blocks and lease unchanged) to ``new_id``; False if there is none. ValueError if
        ``new_id`` is taken."""
        if new_id in self._reservations:
            raise ValueError(f"request {new_id!r} already has a KV reservation")
        reservation = self._reservations.pop(request_id, None)
        if reservation is None:
            return False
        reservation.request_id = new_id
        self._reservations[new_id] = reservation
        return True

    def release(self, request_id: str) -> bool:
        """Free a reservation's blocks; False if there is none (idempotent)."""
        reservation = self._reservations.pop(request_id, None)
        if reservation is None:
            return False
        self.block_pool.free(reservation.block_ids)
        return True

    def expire(self) -> list[str]:
        """Free every reservation whose lease has ended; returns their request ids."""
        now = self._clock()
        expired = [rid for rid, r in self._reservations.items() if r.expires_at_s <= now]
        for rid in expired:
            self.release(rid)
        return expired
