"""Block ids of the paged KV cache: allocate, share (ref counts), free, and remember by name (prefix caching).

The pool owns no tensors (see :mod:`common.engine.kv_cache`); it only decides which block id belongs to
whom. Invariants: a block is free (never used, or in the free queue) exactly when its ref count is 0; a named
block (see :mod:`common.engine.prefix_cache`) holds the KV its name describes, and no two blocks share a name.

A freed block keeps its KV (and name) as long as possible: a later request with the same prefix finds it with
:meth:`lookup` and takes it back with :meth:`share` instead of computing it again. A block in use is never
handed out, so never evicted; :meth:`expire_cached` drops the names of blocks freed too long ago (a TTL).
Which free blocks :meth:`allocate` hands out is the pool's *placement*:

- ``"lru"`` (the default): never-used blocks first, then the head of the free queue (least recently freed
  first). Under churn a request's blocks end up scattered: a decode step adds one block per sequence, and
  sequences free theirs in any order (``benchmarks/block_placement.py``, two real engines: 1.3-2.1 blocks per
  stretch of consecutive ids in a busy decode worker's reservations).
- ``"contiguous"``: a request of one block as ``"lru"``; of more, among the least recently freed free blocks (about
  a quarter of them, :data:`CONTIGUOUS_ELIGIBLE`, and every one holding no named KV), the ``n`` consecutive ones
  whose most recently freed cached block was freed longest ago, or, when no ``n`` of them lie together, their
  longest stretches; a sequence that grows (a decode step's new block, a prompt's next chunk) takes the blocks
  right after its last one when they are free and in reach. A request's KV then lies in a few long runs (one
  NIXL descriptor per run, layer and head: see :mod:`common.kv_transfer.blocks`; 2.5-10x fewer in the
  benchmark), at a price: some cached blocks go before older ones, and a decode worker keeps somewhat less of
  the conversations that ended last. Workers choose it where KV moves by NIXL block writes
  (``--kv-block-placement auto``).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import numpy as np

PLACEMENTS = ("contiguous", "lru")
# Contiguous placement leaves alone the cached blocks freed by the last (1 - this) x (free blocks) frees, so that
# roughly this share of the free blocks, the least recently freed (and those holding no named KV), is in its reach.
# The sequences that ended last free long stretches, which it would take first otherwise: a decode worker would lose
# its latest sessions' KV. benchmarks/block_placement.py (1,536 blocks, 24 streams): of the last 8 ended
# conversations, the share of KV still cached is 0.53 at 1.0, 0.69 at 0.5, 0.79 at 0.25, 0.88 under lru; NIXL
# descriptors per layer 9.2, 14.9, 19.8 and 118.8 (before sequences grew in place: 0.79 and 17.1 since).
CONTIGUOUS_ELIGIBLE = 0.25


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are free than asked for."""


class BlockPool:
    def __init__(self, num_blocks: int, placement: str = "lru") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
        self.num_blocks = num_blocks
        self.placement = placement
        self._ref_counts = [0] * num_blocks
        # never handed out: taken first, in id order (an OrderedDict: a contiguous request may take any of them)
        self._fresh: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._free: OrderedDict[int, float] = OrderedDict()  # freed block -> monotonic time; head: oldest
        self._name_of: dict[int, bytes] = {}
        self._block_named: dict[bytes, int] = {}
        self._num_free_named = 0  # free blocks that still hold named KV (the cached prefixes)
        self._pinned: set[int] = set()  # named blocks the pool itself holds a reference to (warm-up)
        # What handing a block out costs the prefix cache, for contiguous placement: inf in use, 0 free and holding
        # no named KV, else the number of frees before its own (the least recently freed has the smallest)
        self._cost = np.zeros(num_blocks)
        self._num_frees = 0
        self._scratch = (np.empty(num_blocks), np.empty(num_blocks))  # of _window_max
        self._masked = np.empty(num_blocks)  # _cost with the blocks out of reach of contiguous placement at inf
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

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """Take ``n`` free blocks (ref count 1 each, their names dropped), in ascending id order (runs of
        consecutive blocks make KV copies cheap); all or nothing. Which ones: see the module's docstring; under
        contiguous placement, ``after`` (the last block of the sequence they extend) asks for the ``n`` blocks
        right after it, taken when they are free and in reach."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {self.num_free_blocks} free of {self.num_blocks}")
        if n == 0:  # a running sequence's step that needs no new block: the scheduler asks every step
            return []
        contiguous = self.placement == "contiguous"
        if contiguous and after is not None and self._next_in_reach(after, n):
            blocks = list(range(after + 1, after + 1 + n))
        elif contiguous and n >= 2:
            blocks = self._contiguous(n)
        else:
            blocks = None
        if blocks is not None:
            for b in blocks:
                if b in self._fresh:
                    del self._fresh[b]
                else:
                    del self._free[b]
        else:
            blocks = [self._fresh.popitem(last=False)[0] if self._fresh else self._free.popitem(last=False)[0]
                      for _ in range(n)]  # fmt: skip
        self._cost[blocks] = math.inf
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

    def _reach(self, n: int) -> float:
        """The highest cost in reach of a contiguous request of ``n`` blocks: the cached blocks freed by the last
        (1 - CONTIGUOUS_ELIGIBLE) x (free blocks) frees are not (never so many that fewer than n are left)."""
        free = self.num_free_blocks
        recent = min(math.ceil((1 - CONTIGUOUS_ELIGIBLE) * free), free - n)
        return max(self._num_frees - recent, 0) if recent > 0 else math.inf

    def _next_in_reach(self, after: int, n: int) -> bool:
        """Whether the ``n`` blocks after block ``after`` are free and in reach (a sequence growing in place)."""
        if not 0 < n <= self.num_blocks - after - 1:
            return False
        cost = self._cost[after + 1 : after + 1 + n]
        return bool(((cost < math.inf) & (cost <= self._reach(n))).all())

    def _contiguous(self, n: int) -> list[int]:
        """``n`` free block ids for contiguous placement (``n`` <= the free blocks)."""
        # Out of reach: the cached blocks freed by the last frees (O(1), where counting the newest share of the free
        # blocks would take a sort), at inf like the blocks in use.
        reach, cost = self._reach(n), self._cost
        if reach < math.inf:
            cost = self._masked
            np.copyto(cost, self._cost)
            np.putmask(cost, cost > reach, math.inf)
        window = _window_max(cost, n, self._scratch)
        start = int(np.argmin(window)) if len(window) else 0
        if len(window) and window[start] < math.inf:
            return list(range(start, start + n))
        # No n of them together: their longest stretches (then the least recently freed), the last one cut short.
        # At most n stretches are needed: only the n longest are sorted.
        edges = np.flatnonzero(np.diff(cost < math.inf, prepend=False, append=False))
        starts, ends = edges[0::2], edges[1::2]
        lengths = ends - starts
        if len(lengths) > n:
            top = np.sort(np.argpartition(-lengths, n - 1)[:n])
            starts, ends, lengths = starts[top], ends[top], lengths[top]
        bounds = np.stack((starts, ends), axis=1).reshape(-1)
        newest = np.maximum.reduceat(cost, bounds[:-1] if bounds[-1] == len(cost) else bounds)[0::2]
        blocks: list[int] = []
        for i in np.lexsort((newest, -lengths)):
            blocks.extend(range(int(starts[i]), min(int(ends[i]), int(starts[i]) + n - len(blocks))))
            if len(blocks) == n:
                break
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
                self._num_frees += 1
                self._cost[b] = 0.0
                if b in self._name_of:
                    self._num_free_named += 1
                    self._cost[b] = self._num_frees

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
                self._cost[b] = 0.0
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
                self._cost[b] = math.inf
            self._ref_counts[b] += 1


def _window_max(values: np.ndarray, n: int, scratch: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """``out[i] = values[i : i + n].max()`` for every window of ``n`` in ``values`` (empty when ``n`` > its length),
    in ``log2(n)`` passes of elementwise maxima: the maxima of windows of 1, 2, 4, ... p <= n, then two windows of p
    cover one of n. ``scratch``: two arrays of ``len(values)``, which the result is a view of (no allocation: a
    fresh array of a big pool costs page faults that dwarf the arithmetic)."""
    size = len(values)
    if n > size:
        return values[:0]
    src, p, turn = values, 1, 0
    while 2 * p <= n:
        m = size - 2 * p + 1
        src = np.maximum(src[:m], src[p : p + m], out=scratch[turn][:m])
        p, turn = 2 * p, 1 - turn
    m = size - n + 1
    return np.maximum(src[:m], src[n - p : n - p + m], out=scratch[turn][:m])
