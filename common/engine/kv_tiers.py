"""Spill tiers of the prefix cache: evicted blocks move to host memory, then to a shared store (Redis).

The tiered cache of the field (device → host → shared store), on pdserve's block names
(:mod:`common.engine.prefix_cache`). When the block pool hands out a named free block, the engine first
copies its KV ([L, 2, H, bs, D], every layer) into :class:`KVTiers`: into the host tier, an LRU of at most
``host_blocks`` blocks; what the host tier evicts goes to the shared tier, when there is one. A request
admitted with a prefix the device cache lacks continues its lookup here, block by block from the first
missing one; found blocks are loaded into fresh device blocks and count as prefix-cache hits.

The shared tier (:class:`RedisKVStore`) lets a prefix computed on one worker serve another: keys carry the
model's KV identity (fingerprint, dtype, block shape), so only engines that would compute the same bytes share
them; values expire after ``ttl_s`` and the store keeps at most ``max_blocks`` of them (oldest dropped).
With a :class:`~common.security.kv_crypto.KVCipher`, values are sealed (AES-256-GCM, bound to their Redis key)
and the key space carries the key's fingerprint; a value that fails authentication is deleted, counted in
``num_integrity_failures`` and treated as missing, so the engine recomputes that block (it is never used).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from common.security.kv_crypto import KVCipher

log = logging.getLogger(__name__)


class RedisKVStore:
    """Blocks' KV bytes in Redis under ``{prefix}kvblock:{space}:{name hex}``, with an LRU-ish cap.

    With a cipher, ``space`` becomes ``{space}-k{key fingerprint}`` and values are sealed (nonce + ciphertext
    + tag, :data:`common.security.kv_crypto.OVERHEAD_BYTES` more than the block).
    """

    def __init__(self, client, *, prefix: str, space: str, shape: Sequence[int], dtype: torch.dtype,
                 ttl_s: float = 600.0, max_blocks: int = 4096, cipher: KVCipher | None = None) -> None:
        """``space``: the KV identity (model fingerprint, dtype, block shape): engines that share a space
        compute identical blocks. ``shape``/``dtype``: one block's tensor ([L, 2, H, bs, D]). ``cipher``:
        encrypt and authenticate every value (None: plaintext, in a key space without a fingerprint)."""
        from common.state.keys import check_prefix

        self._client = client
        self._cipher = cipher
        self.space = space if cipher is None else f"{space}-k{cipher.fingerprint}"
        self._base = f"{check_prefix(prefix)}kvblock:{self.space}:"
        self._index = f"{check_prefix(prefix)}kvblocks:{self.space}"  # sorted set: name -> time stored
        self.shape, self.dtype = tuple(shape), dtype
        self.nbytes = int(torch.empty(self.shape, dtype=dtype).nbytes)
        self.ttl_ms, self.max_blocks = max(1, round(ttl_s * 1000)), max_blocks
        self.num_integrity_failures = 0  # sealed values that failed authentication (deleted, recomputed)

    def key(self, name: bytes) -> str:
        """The Redis key of block ``name`` (also the associated data of its sealed value)."""
        return self._base + name.hex()

    def put(self, name: bytes, kv: torch.Tensor) -> None:
        data = kv.contiguous().view(torch.uint8).numpy().tobytes()
        key = self.key(name)
        if self._cipher is not None:
            data = self._cipher.seal(key.encode(), data)
        pipe = self._client.pipeline(transaction=False)
        pipe.set(key, data, px=self.ttl_ms)
        pipe.zadd(self._index, {name.hex(): time.time()})
        pipe.zcard(self._index)
        count = pipe.execute()[-1]
        if count > self.max_blocks:  # drop the oldest beyond the cap
            old = self._client.zpopmin(self._index, count - self.max_blocks)
            if old:
                self._client.delete(*(self._base + (n.decode() if isinstance(n, bytes) else n) for n, _ in old))

    def get_run(self, names: Sequence[bytes]) -> list[torch.Tensor]:
        """The KV of ``names`` from the first on, up to the first one missing (one round trip)."""
        if not names:
            return []
        keys = [self.key(n) for n in names]
        out = []
        for name, key, data in zip(names, keys, self._client.mget(keys)):
            if data is None:
                break
            if self._cipher is not None:
                data = self._open(name, key, data)
                if data is None:
                    break
            if len(data) != self.nbytes:
                break
            out.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype).view(self.shape))
        return out

    def _open(self, name: bytes, key: str, sealed: bytes) -> bytes | None:
        """The block's plaintext; None (after deleting the value and counting it) when it fails authentication."""
        from common.security.kv_crypto import KVIntegrityError

        try:
            return self._cipher.open(key.encode(), sealed)
        except KVIntegrityError as exc:
            self.num_integrity_failures += 1
            log.warning("shared KV tier: dropped block %s: %s", key, exc)
            try:
                pipe = self._client.pipeline(transaction=False)
                pipe.delete(key)
                pipe.zrem(self._index, name.hex())
                pipe.execute()
            except Exception as delete_exc:  # noqa: BLE001 - the block is not used either way
                log.debug("could not delete %s: %s", key, delete_exc)
            return None


class KVTiers:
    """Host tier (LRU of ``host_blocks``) in front of an optional shared store. One thread (the engine's)."""

    def __init__(self, host_blocks: int, shared: RedisKVStore | None = None) -> None:
        if host_blocks < 0:
            raise ValueError(f"host_blocks must be >= 0, got {host_blocks}")
        self.host_blocks = host_blocks
        self.shared = shared
        self._host: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_host_hits = 0
        self.num_shared_hits = 0

    @property
    def num_integrity_failures(self) -> int:
        """Blocks of the shared tier that failed authentication (0 without an encrypted shared tier)."""
        return 0 if self.shared is None else self.shared.num_integrity_failures

    def put(self, name: bytes, kv: torch.Tensor) -> None:
        """An evicted block's KV: into the host tier (its LRU victim, or this block when there is no host
        tier, goes to the shared store)."""
        if self.host_blocks:
            self._host[name] = kv
            self._host.move_to_end(name)
            if len(self._host) <= self.host_blocks:
                return
            name, kv = self._host.popitem(last=False)
        if self.shared is not None:
            try:
                self.shared.put(name, kv)
            except Exception as exc:  # noqa: BLE001 - the shared tier is an optimisation: never fail a step
                log.debug("KV block not spilled to the shared tier: %s", exc)

    def get_run(self, names: Sequence[bytes]) -> list[torch.Tensor]:
        """KV of ``names`` from the first on, as far as the tiers hold them in a row (host first)."""
        out = []
        for name in names:
            kv = self._host.get(name)
            if kv is None:
                break
            self._host.move_to_end(name)
            out.append(kv)
        self.num_host_hits += len(out)
        if len(out) < len(names) and self.shared is not None:
            try:
                more = self.shared.get_run(names[len(out):])
            except Exception as exc:  # noqa: BLE001
                log.debug("shared KV tier unavailable: %s", exc)
                more = []
            self.num_shared_hits += len(more)
            out += more
        return out
