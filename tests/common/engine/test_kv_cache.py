from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common.engine import kv_cache
from common.engine.kv_cache import KVCacheSpec, PagedKVCache

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=3, dtype=torch.float32)
NUM_BLOCKS = 48


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(NUM_BLOCKS)), st.integers(1, NUM_BLOCKS), st.integers(0, 1))
def test_write_then_read_blocks_round_trips_and_touches_nothing_else(order, n, layer):
    """Any block order: one run, a few runs (strided copies) or many (gather/scatter)."""
    block_ids = order[:n] if n % 3 else sorted(order[:n])  # sorted: few long runs; else mostly scattered
    cache = PagedKVCache(SPEC, NUM_BLOCKS)
    cache.data.copy_(torch.randn_like(cache.data))
    before = cache.data.clone()
    key, value = torch.randn(*SPEC.block_shape(n)), torch.randn(*SPEC.block_shape(n))
    cache.write_blocks(layer, block_ids, key, value)
    k, v = cache.read_blocks(layer, block_ids)
    assert torch.equal(k, key) and torch.equal(v, value)
    for i, b in enumerate(block_ids):  # [L, 2, H, N, bs, D]: block b of head h holds token-major rows
        assert torch.equal(cache.data[layer, 0, :, b], key[i].permute(1, 0, 2))
    untouched = torch.ones(NUM_BLOCKS, dtype=torch.bool)
    untouched[block_ids] = False
    assert torch.equal(cache.data[:, :, :, untouched], before[:, :, :, untouched])
    assert torch.equal(cache.data[1 - layer], before[1 - layer])


def _anon_huge_kib(address: int) -> int | None:
    """AnonHugePages (KiB) of this process's mapping that holds ``address``, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return None


def test_cpu_cache_memory_is_on_huge_pages_where_the_system_allows():
    """The cache's memory is advised onto transparent huge pages before it is zeroed: with THP in ``madvise`` or
    ``always`` mode its mapping holds huge pages; switched off (the module flag), it is still zeroed."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("no transparent huge pages on this system")
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    cache = PagedKVCache(spec, num_blocks=1024)  # 16 MiB
    assert cache.huge_pages and bool((cache.data == 0).all())
    assert (_anon_huge_kib(cache.data.data_ptr() + cache.data.numel() * 2) or 0) >= 2048
    kv_cache.HUGE_PAGES = False
    try:
        plain = PagedKVCache(spec, num_blocks=64)
    finally:
        kv_cache.HUGE_PAGES = True
    assert not plain.huge_pages and bool((plain.data == 0).all())


def test_huge_pages_can_be_turned_off_by_environment():
    """``PDSERVE_KV_HUGE_PAGES=0``: a worker's cache keeps 4 KiB pages (no advice asked)."""
    code = ("import torch\nfrom common.engine.kv_cache import KVCacheSpec, PagedKVCache\n"
            "spec = KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32)\n"
            "print(PagedKVCache(spec, num_blocks=4096).huge_pages)\n")  # fmt: skip
    thp = Path("/sys/kernel/mm/transparent_hugepage").exists()  # a kernel without THP refuses the advice
    for value, expected in (("0", "False"), ("1", str(thp))):
        env = dict(os.environ, PDSERVE_KV_HUGE_PAGES=value)
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip() == expected
