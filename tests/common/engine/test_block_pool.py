from __future__ import annotations

import pytest

from common.engine.block_pool import BlockPool, NoFreeBlocksError


def test_allocate_hands_out_the_least_recently_freed_blocks_in_ascending_order():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    pool.free([1])
    assert pool.allocate(2) == [1, 3]  # 3 waited longest, then 1; handed out sorted
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
    pool.allocate(3)
    pool.free(first)
    assert pool.allocate(5) == [0, 1, 2, 3, 4]


def test_named_blocks_are_reused_until_handed_out_and_the_tail_goes_first():
    pool = BlockPool(6)
    a = pool.allocate(3)
    names = [b"n0", b"n1", b"n2"]
    for block, name in zip(a, names):
        assert pool.name(block, name)
    assert not pool.name(a[0], b"other") and not pool.name(pool.allocate(1)[0], b"n0")  # one name each way
    assert pool.lookup(names + [b"n3"]) == a and pool.lookup([b"n1"]) == [a[1]] and pool.lookup([b"x"]) == []
    pool.free(a)  # cached: free, but still named
    assert (pool.num_free_blocks, pool.num_cached_blocks) == (5, 3)
    hits = pool.lookup(names[:2])
    pool.share(hits)  # taken back from the free queue
    assert [pool.ref_count(b) for b in hits] == [1, 1]
    assert (pool.num_free_blocks, pool.num_cached_blocks) == (3, 1)
    pool.share(hits)  # a second user of blocks in use
    assert [pool.ref_count(b) for b in hits] == [2, 2]
    # Evictions take the least recently freed first: the never-used blocks, then n2 (freed before n0, n1
    # were shared again); blocks in use are never handed out.
    got = pool.allocate(3)
    assert a[2] in got and not set(got) & set(hits)
    assert pool.lookup(names) == hits and pool.num_cached_blocks == 0
    with pytest.raises(ValueError, match="holds no named KV"):
        pool.share([got[0]])
    with pytest.raises(ValueError, match="only allocated blocks get names"):
        BlockPool(1).name(0, b"n")


def test_cached_blocks_expire_after_their_ttl(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("common.engine.block_pool.time.monotonic", lambda: now[0])
    pool = BlockPool(4)
    a, b = pool.allocate(1) + pool.allocate(1)
    pool.name(a, b"a")
    pool.name(b, b"b")
    pool.free([a])
    now[0] = 105.0
    pool.free([b])
    assert pool.expire_cached(10.0) == 0
    now[0] = 112.0  # a idle 12 s, b 7 s
    assert pool.expire_cached(10.0) == 1
    assert pool.lookup([b"a"]) == [] and pool.lookup([b"b"]) == [b] and pool.num_cached_blocks == 1
    assert pool.num_free_blocks == 4  # expiring drops the name, not the block
