"""Block ids of the paged KV cache: allocate, share (ref counts), free, and remember by name (prefix caching).

The pool owns no tensors (see :mod:`common.engine.kv_cache`); it only decides which block id belongs to
whom. Invariants: a block is free (never used, or in the free queue) exactly when its ref count is 0; a named
block (see :mod:`common.engine.prefix_cache`) holds the KV its name describes, and no two blocks share a name.

:meth:`allocate` takes never-used blocks first, then from the head of the free queue (least recently
freed first), so a freed block keeps its KV (and name) as long as possible: a later request with the same
prefix finds it with :meth:`lookup` and takes it back with :meth:`share` instead of computing it again. A
block in use is never handed out, so never evicted; :meth:`expire_cached` drops the names of blocks freed
too long ago (a TTL).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are free than asked for."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._fresh: deque[int] = deque(range(num_blocks))  # never handed out: taken first, in id order
        self._free: OrderedDict[int, float] = OrderedDict()  # freed block -> monotonic time; head: oldest
        self._name_of: dict[int, bytes] = {}
        self._block_named: dict[bytes, int] = {}
        self._num_free_named = 0  # free blocks that still hold named KV (the cached prefixes)
        self._pinned: set[int] = set()  # named blocks the pool itself holds a reference to (warm-up)
        # Called as on_evict(block_id, name) when a named free block is handed out, before its KV is
        # overwritten: the prefix cache's spill tiers copy it out (see common.engine.kv_tiers).
        self.on_evict: Callable[[int, bytes], None] | None = None
        # Set to a deque to get (name, held) each time a name is recorded (True) or dropped (False), oldest
        # first; another thread may drain it with popleft (a worker publishing its prefix index).
        self.name_events: deque[tuple[bytes, bool]] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out (cached ones included: they are evicted when handed out)."""
        return len(self._fresh) + len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a cached prefix's KV and no live request: free ones (reusable until handed out)
        and pinned ones nobody else uses."""
        return self._num_free_named + self._num_pinned_idle()

    @property
    def num_live_blocks(self) -> int:
        """Blocks held by requests and reservations (pinned prefixes not counted unless a request uses them)."""
        return self.num_used_blocks - self._num_pinned_idle()

    def _num_pinned_idle(self) -> int:
        return sum(1 for b in self._pinned if self._ref_counts[b] == 1)

    def usage(self) -> float:
        """Share of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref count 1 each, their names dropped), in ascending id order (runs of
        consecutive blocks make KV copies cheap); all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {self.num_free_blocks} free of {self.num_blocks}")
        blocks = [self._fresh.popleft() if self._fresh else self._free.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
            name = self._name_of.pop(b, None)
            if name is not None:
                if self.on_evict is not None:
                    self.on_evict(b, name)
                del self._block_named[name]
                self._num_free_named -= 1
                if self.name_events is not None:
                    self.name_events.append((name, False))
        blocks.sort()
        return blocks

    def incref(self, block_ids: Sequence[int]) -> None:
        """Share blocks that are already allocated (one more owner each)."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                raise ValueError(f"block {b} is free; only allocated blocks can be shared")
            self._ref_counts[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 joins the free queue's tail.

        Freed last block first: a sequence's later blocks are evicted before its earlier ones, whose names
        every longer prefix's chain goes through."""
        for b in reversed(block_ids):
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = time.monotonic()
                if b in self._name_of:
                    self._num_free_named += 1

    def expire_cached(self, max_idle_s: float) -> int:
        """Drop the names of cached blocks freed more than ``max_idle_s`` ago (their KV will not be reused);
        returns how many. Looks at the free queue's head only, so it costs nothing when nothing expires."""
        deadline = time.monotonic() - max_idle_s
        dropped = 0
        for b, freed_at in self._free.items():
            if freed_at > deadline:
                break
            name = self._name_of.pop(b, None)
            if name is not None:
                del self._block_named[name]
                self._num_free_named -= 1
                dropped += 1
                if self.name_events is not None:
                    self.name_events.append((name, False))
        return dropped

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # -- prefix caching -----------------------------------------------------------------------------------

    def name(self, block_id: int, name: bytes) -> bool:
        """Record that an allocated block holds the KV named ``name``; False (nothing recorded) if another
        block already holds it or this one has a name."""
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only allocated blocks get names")
        if name in self._block_named or block_id in self._name_of:
            return False
        self._name_of[block_id] = name
        self._block_named[name] = block_id
        if self.name_events is not None:
            self.name_events.append((name, True))
        return True

    def lookup(self, names: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest prefix of ``names`` (in order; nothing taken)."""
        out = []
        for name in names:
            b = self._block_named.get(name)
            if b is None:
                break
            out.append(b)
        return out

    def pin(self, block_ids: Sequence[int]) -> int:
        """Hold named blocks for good (warm-up): they are never evicted. Returns how many were not pinned yet."""
        new = [b for b in dict.fromkeys(block_ids) if b not in self._pinned]
        self.share(new)
        self._pinned.update(new)
        return len(new)

    def share(self, block_ids: Sequence[int]) -> None:
        """Take one more reference to named blocks found by :meth:`lookup`, free (cached) or in use."""
        for b in block_ids:
            if b not in self._name_of:
                raise ValueError(f"block {b} holds no named KV")
            if self._ref_counts[b] == 0:
                del self._free[b]
                self._num_free_named -= 1
            self._ref_counts[b] += 1
