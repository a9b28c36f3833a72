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


# -- placement ----------------------------------------------------------------------------------------------


def _pool_with_holes(placement: str) -> BlockPool:
    """12 blocks, each taken alone; then freed: 3, 9, 10, 11, 5 (in that order). Free: 3, 5, 9-11."""
    pool = BlockPool(12, placement)
    for _ in range(12):
        pool.allocate(1)
    for b in (3, 9, 10, 11, 5):
        pool.free([b])
    return pool


def test_lru_placement_takes_the_least_recently_freed_wherever_they_lie():
    assert _pool_with_holes("lru").allocate(3) == [3, 9, 10]


def test_contiguous_placement_takes_consecutive_free_blocks():
    pool = _pool_with_holes("contiguous")
    assert pool.allocate(3) == [9, 10, 11]
    assert pool.allocate(1) == [3]  # one block: the least recently freed, as lru
    assert pool.num_free_blocks == 1


def test_contiguous_placement_evicts_the_stretch_whose_newest_cached_block_was_freed_first():
    pool = BlockPool(12, "contiguous")
    a, b, c = pool.allocate(4), pool.allocate(4), pool.allocate(4)
    for i, block in enumerate(a + b):
        pool.name(block, f"n{i}".encode())
    pool.free(b)  # b freed before a: its blocks are the older cache
    pool.free(a)
    pool.free(c)  # freed last but holds nothing: taking it costs no cached prefix
    assert pool.allocate(4) == c and pool.num_cached_blocks == 8
    assert pool.allocate(3) == b[1:]  # b's tail, freed first of all (a sequence frees its last block first)
    assert pool.lookup([b"n0", b"n1", b"n2", b"n3"]) == a and pool.lookup([b"n4"]) == [b[0]]
    assert pool.num_cached_blocks == 5


def test_contiguous_placement_takes_the_longest_stretches_when_no_window_is_free():
    pool = BlockPool(16, "contiguous")
    for _ in range(16):
        pool.allocate(1)
    for run in ([0], [2, 3, 4], [6, 7], [9, 10, 11, 12], [14]):
        pool.free(run)
    assert pool.allocate(8) == [2, 3, 4, 6, 9, 10, 11, 12]  # 4 + 3 + the first of the 2
    assert pool.allocate(3) == [0, 7, 14]


def test_a_contiguous_sequence_grows_in_place_when_the_next_blocks_are_free_and_in_reach():
    pool = BlockPool(10, "contiguous")
    seq = pool.allocate(3)  # 0-2
    other = pool.allocate(2)  # 3-4
    assert pool.allocate(1, after=seq[-1]) == [5]  # 3 is in use: the next fresh block, as lru
    pool.free(other)
    assert pool.allocate(2, after=seq[-1]) == [3, 4]
    pool = BlockPool(12, "contiguous")
    seq, cached = pool.allocate(3), pool.allocate(2)
    for i, block in enumerate(cached):
        pool.name(block, f"c{i}".encode())
    pool.allocate(7)
    pool.free(cached)  # the most recently freed cached blocks: out of reach
    assert pool.allocate(1, after=seq[-1]) == [4] and pool.lookup([b"c0"]) == [3]  # the LRU head, c1's block
    assert BlockPool(4, "lru").allocate(1, after=0) == [0]  # lru takes no hint
    pool = BlockPool(3, "contiguous")
    seq, _ = pool.allocate(1), pool.allocate(1)
    assert pool.allocate(1, after=seq[-1]) == [2]  # the last free block; the one after seq is in use


def test_placement_is_checked():
    with pytest.raises(ValueError, match="placement must be one of contiguous, lru"):
        BlockPool(4, "best")


@pytest.mark.parametrize("placement", ["contiguous", "lru"])
def test_random_use_keeps_the_pool_consistent(placement):
    """Allocate, share, name, free and expire at random; the pool's books agree with a plain model throughout."""
    import random

    rng = random.Random(7)
    pool = BlockPool(64, placement)
    owners: list[list[int]] = []  # each entry: the blocks one owner holds
    refs = [0] * 64
    for step in range(3000):
        op = rng.random()
        free_now = [b for b in range(64) if refs[b] == 0]
        assert pool.num_free_blocks == len(free_now)
        if op < 0.4 and free_now:
            n = rng.randint(1, min(12, len(free_now)))
            got = pool.allocate(n, after=rng.choice(owners)[-1] if owners and rng.random() < 0.5 else None)
            assert got == sorted(got) and len(set(got)) == n and all(refs[b] == 0 for b in got)
            for b in got:
                refs[b] = 1
                if rng.random() < 0.6:
                    pool.name(b, f"s{step}-{b}".encode())
            owners.append(got)
        elif op < 0.5 and owners:
            shared = rng.choice(owners)
            pool.incref(shared)
            for b in shared:
                refs[b] += 1
            owners.append(list(shared))
        elif op < 0.6:
            names = [name for name, _ in list(pool._block_named.items())[:3]]
            hits = pool.lookup(names[:1])
            pool.share(hits)
            for b in hits:
                refs[b] += 1
            if hits:
                owners.append(hits)
        elif op < 0.62:
            pool.expire_cached(0.0)
        elif owners:
            gone = owners.pop(rng.randrange(len(owners)))
            pool.free(gone)
            for b in gone:
                refs[b] -= 1
        assert [pool.ref_count(b) for b in range(64)] == refs
        cost = pool._cost
        assert all((cost[b] < float("inf")) == (refs[b] == 0) for b in range(64))
        assert all(cost[b] > 0 for b in pool._name_of if refs[b] == 0)
        assert pool.num_cached_blocks == sum(1 for b in pool._name_of if refs[b] == 0)


def test_contiguous_placement_leaves_the_most_recently_freed_cached_blocks_alone():
    pool = BlockPool(8, "contiguous")
    a, b = pool.allocate(4), pool.allocate(4)
    for i, block in enumerate(a + b):
        pool.name(block, f"n{i}".encode())
    pool.free([a[0]])
    pool.free([a[2]])
    pool.free(b)  # 6 free; within reach: 0 and 2, freed first
    assert pool.allocate(2) == [0, 2]  # not b's stretch, freed last, though it lies together
    assert pool.lookup([f"n{i}".encode() for i in range(4, 8)]) == b


def test_workers_choose_the_placement_by_flag_or_environment(monkeypatch):
    import argparse

    from common.config.loader import add_config_args, resolve_config
    from common.engine.config import EngineConfig
    from services.worker.config import WorkerConfig
    from services.worker.runtime import block_placement, weight_layout

    def placement(role, argv, env=None):
        parser = argparse.ArgumentParser()
        add_config_args(parser, WorkerConfig)
        config = resolve_config(WorkerConfig, parser.parse_args(["--model", "m", *argv]), env=env or {}).config
        return block_placement(role, config)

    monkeypatch.delenv("PDSERVE_NIXL_BLOCKS", raising=False)
    # auto: contiguous only where KV moves by NIXL block writes
    assert placement("decode", []) == placement("prefill", []) == "lru"
    assert placement("prefill", ["--kv-transport", "shm"]) == "lru"
    assert placement("decode", ["--kv-nixl"]) == placement("prefill", ["--kv-transport", "nixl"]) == "contiguous"
    assert placement("decode", ["--kv-nixl", "--tensor-parallel-size", "2"]) == "lru"  # arenas, not block writes
    monkeypatch.setenv("PDSERVE_NIXL_BLOCKS", "0")
    assert placement("decode", ["--kv-nixl"]) == "lru"
    # chosen outright, by flag or environment
    assert placement("decode", ["--kv-block-placement", "contiguous"]) == "contiguous"
    assert placement("decode", ["--kv-nixl"], {"PDSERVE_KV_BLOCK_PLACEMENT": "lru"}) == "lru"
    with pytest.raises(ValueError, match="PDSERVE_KV_BLOCK_PLACEMENT: 'best' is not one of"):
        placement("decode", [], {"PDSERVE_KV_BLOCK_PLACEMENT": "best"})
    assert EngineConfig().kv_block_placement == "lru"  # a bare engine moves no KV
    # the weights' layouts: for prefill on a prefill worker, for decode elsewhere, unless chosen
    parser = argparse.ArgumentParser()
    add_config_args(parser, WorkerConfig)
    for role, argv, want in (("prefill", [], "prefill"), ("decode", [], "decode"), ("", [], "decode"),
                             ("prefill", ["--weight-layout", "decode"], "decode"),
                             ("decode", ["--weight-layout", "prefill"], "prefill")):  # fmt: skip
        config = resolve_config(WorkerConfig, parser.parse_args(["--model", "m", *argv]), env={}).config
        assert weight_layout(role, config) == want, (role, argv)
    assert EngineConfig().weight_layout == "decode"
    with pytest.raises(ValueError, match="kv_block_placement must be one of contiguous, lru"):
        EngineConfig(kv_block_placement="auto")
