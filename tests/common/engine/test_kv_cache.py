from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
