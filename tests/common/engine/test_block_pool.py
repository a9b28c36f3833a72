from __future__ import annotations

import pytest

from common.engine.block_pool import BlockPool, NoFreeBlocksError


def test_allocate_hands_out_low_ids_first_and_free_returns_them():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    pool.free([1])
    assert pool.allocate(2) == [1, 3]
    assert pool.usage() == 1.0


def test_allocate_is_all_or_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocksError, match="asked for 2 KV blocks, 1 free of 3"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_shared_block_is_freed_when_its_last_owner_lets_go():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.num_free_blocks == 1 and pool.ref_count(b) == 1
    pool.free([b])
    assert pool.num_free_blocks == 2


def test_double_free_and_sharing_a_free_block_are_errors():
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="block 0 freed more often"):
        pool.free([0])
    with pytest.raises(ValueError, match="block 1 is free"):
        pool.incref([1])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_a_freed_run_comes_back_in_ascending_order():
    """KV copies of consecutive ascending blocks are one strided copy (see PagedKVCache.write_blocks)."""
    pool = BlockPool(8)
    first = pool.allocate(5)
    pool.allocate(2)
    pool.free(first)
    assert pool.allocate(5) == [0, 1, 2, 3, 4]
