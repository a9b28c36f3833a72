"""Prefix caching: KV blocks named by chained hashes of their token ids.

A full block's hash covers its own tokens and, through its parent's hash, every token before it, so two
requests whose prompts start with the same ``k * block_size`` tokens name their first ``k`` blocks alike: the
second reuses the first's KV for them and computes only the rest. The hash is SHA-256 (truncated to 16
bytes) of the parent hash and the block's token ids as little-endian uint32: stable across processes and
hosts, so the names can be shared (a prefix index in Redis, a shared KV tier).

Only full blocks are named; a block is named once its KV is computed, and it keeps its name while in use
and, after its last user frees it, while it waits in the block pool's LRU free queue
(:class:`common.engine.block_pool.BlockPool`); it loses it when it is handed out again.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 16
ROOT = b"\x00" * HASH_BYTES  # the parent of a prompt's first block


def chain_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The name of a block holding ``token_ids`` after the block named ``parent``."""
    digest = hashlib.sha256(parent)
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return digest.digest()[:HASH_BYTES]


def block_hashes(token_ids: Sequence[int], block_size: int, known: Sequence[bytes] = (),
                 max_blocks: int | None = None) -> list[bytes]:
    """Names of the full blocks of ``token_ids`` (at most ``max_blocks``), extending ``known`` (the names of
    its first ``len(known)`` blocks, already computed). Returns the whole list, ``known`` included."""
    out = list(known)
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    parent = out[-1] if out else ROOT
    for i in range(len(out), n):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out
