"""Block ids of the paged KV cache: allocate, share (ref counts) and free.

The pool owns no tensors (see :mod:`common.engine.kv_cache`); it only decides which block id belongs to
whom. Invariant: a block is in the free list exactly when its ref count is 0.
"""

from __future__ import annotations


class NoFreeBlocksError(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when fewer blocks are free than asked for."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        # Popped from the end: block 0 is handed out first, which keeps tests' block ids predictable.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Share of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (ref count 1 each); all or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def incref(self, block_ids: list[int]) -> None:
        """Share blocks that are already allocated (one more owner each)."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                raise ValueError(f"block {b} is free; only allocated blocks can be shared")
            self._ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 goes back to the free list.

        Pushed in reverse so that a freed run of consecutive blocks is handed out again in ascending order:
        KV copies of consecutive blocks are one strided copy instead of a gather."""
        for b in reversed(block_ids):
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]
