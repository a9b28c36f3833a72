"""Prefix caching: chained block names, reuse of a cached prefix's KV, LRU eviction; outputs stay equal to
stock ``generate`` and to an engine without the cache."""

from __future__ import annotations

import random

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.loader import load_model
from common.engine.prefix_cache import ROOT, block_hashes, chain_hash
from common.engine.sampling_params import SamplingParams
from tests.conftest import hf_greedy

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def test_names_chain_through_every_earlier_token():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2 and a[0] == chain_hash(ROOT, list(range(16))) and a[1] == chain_hash(a[0], list(range(16, 32)))
    assert block_hashes(list(range(40)), 16, known=a[:1]) == a  # extends what is known
    assert block_hashes(list(range(40)), 16, max_blocks=1) == a[:1]
    b = block_hashes([99] + list(range(1, 40)), 16)
    assert b[0] != a[0] and b[1] != a[1]  # same tokens in block 1, different prefix: different name
    assert len(a[0]) == 16


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir)


def run(engine: LLMEngine, prompt: list[int]) -> list[int]:
    [result] = engine.generate([prompt], GREEDY)
    return result.token_ids


def test_a_shared_prefix_is_computed_once_and_outputs_equal_generate(loaded, model_dir, hf_reference):
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, max_model_len=512))
    rng = random.Random(0)
    system = [rng.randrange(4, 4000) for _ in range(100)]  # 6 full blocks of 16, and 4 tokens
    prompts = [system + [rng.randrange(4, 4000) for _ in range(n)] for n in (7, 20, 3)]
    outs = [run(engine, p) for p in prompts]
    c = engine.counters
    assert c.num_prefix_cache_queries == sum(len(p) for p in prompts)
    assert c.num_prefix_cache_hits == 2 * 96  # the 2nd and 3rd request reuse the 6 full blocks
    assert c.num_prompt_tokens == sum(len(p) for p in prompts)  # tokens served; computed ones are fewer
    hf = hf_reference(model_dir)
    assert outs == [hf_greedy(hf, p, 8) for p in prompts]


def test_the_same_prompt_again_reuses_all_but_its_last_block(loaded):
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, max_model_len=512))
    prompt = list(range(10, 74))  # exactly 4 blocks
    first, second = run(engine, prompt), run(engine, prompt)
    assert first == second
    assert engine.counters.num_prefix_cache_hits == 48  # 3 blocks: the last token must be computed again
    assert engine.block_pool.num_used_blocks == 0 and engine.block_pool.num_cached_blocks > 0


def test_eviction_under_pressure_keeps_outputs_equal_to_an_engine_without_the_cache(loaded):
    rng = random.Random(1)
    prefixes = [[rng.randrange(4, 4000) for _ in range(48)] for _ in range(3)]
    prompts = [rng.choice(prefixes) + [rng.randrange(4, 4000) for _ in range(rng.randrange(1, 30))]
               for _ in range(24)]
    cached = LLMEngine(loaded, EngineConfig(num_kv_blocks=24, max_model_len=128, max_num_seqs=4))
    plain = LLMEngine(loaded, EngineConfig(num_kv_blocks=24, max_model_len=128, max_num_seqs=4,
                                           prefix_caching=False))
    for i in range(0, len(prompts), 4):  # batches of 4 share the small pool; cached blocks get evicted
        batch = prompts[i : i + 4]
        assert [r.token_ids for r in cached.generate(batch, GREEDY)] == [
            r.token_ids for r in plain.generate(batch, GREEDY)]
    assert cached.counters.num_prefix_cache_hits > 0 and plain.counters.num_prefix_cache_queries == 0
    assert cached.block_pool.num_used_blocks == 0 == plain.block_pool.num_used_blocks


def test_prefilled_and_exported_blocks_stay_cached_for_the_next_prompt(loaded):
    """A prefill worker: the KV leaves with export_kv, its blocks stay named for the next request."""
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, max_model_len=512))
    prompt = list(range(5, 60))
    rid = engine.add_request(prompt, GREEDY, prefill_only=True)
    while engine.has_unfinished_requests():
        engine.step()
    engine.export_kv(rid)
    assert engine.block_pool.num_cached_blocks == 3
    rid = engine.add_request(prompt + [7, 8], GREEDY, prefill_only=True)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.counters.num_prefix_cache_hits == 48


def test_evicted_prefixes_come_back_from_the_host_tier(loaded):
    from common.engine.kv_tiers import KVTiers

    tiers = KVTiers(host_blocks=64)
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=12, max_model_len=160, max_num_seqs=1))
    engine.attach_kv_tiers(tiers)
    plain = LLMEngine(loaded, EngineConfig(num_kv_blocks=12, max_model_len=160, max_num_seqs=1,
                                           prefix_caching=False))
    rng = random.Random(4)
    a, b = ([rng.randrange(4, 4000) for _ in range(100)] for _ in range(2))
    # a takes 7 of the 12 blocks; b takes the 5 never used, then a's last two (tail first: one of them
    # named); a's prefix then comes back: 5 blocks from the device cache, the evicted one from the host tier.
    prompts = [a + [5], b + [6], a + [7]]
    assert [run(engine, p) for p in prompts] == [run(plain, p) for p in prompts]
    assert tiers.num_host_hits == 1 and engine.counters.num_prefix_cache_hits == 96


def test_the_shared_tier_carries_a_prefix_to_another_engine(loaded):
    from common.engine.kv_tiers import KVTiers, RedisKVStore
    from common.state.redis_client import connect
    from tests.redis_server import RedisServer

    rng = random.Random(8)
    prefix = [rng.randrange(4, 4000) for _ in range(64)]
    with RedisServer() as server:
        def engine_with_store():
            engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=10, max_model_len=150, max_num_seqs=1))
            spec = engine.kv_spec
            shape = (spec.num_layers, 2, spec.num_kv_heads, spec.block_size, spec.head_dim)
            store = RedisKVStore(connect(server.url), prefix="t:", space="tiny", shape=shape, dtype=spec.dtype,
                                 ttl_s=60, max_blocks=8)
            tiers = KVTiers(host_blocks=0, shared=store)
            engine.attach_kv_tiers(tiers)
            return engine, tiers

        first, _ = engine_with_store()
        run(first, prefix + [1])
        run(first, [rng.randrange(4, 4000) for _ in range(140)])  # evicts the prefix into Redis
        second, tiers = engine_with_store()
        plain = LLMEngine(loaded, EngineConfig(num_kv_blocks=10, max_model_len=150, prefix_caching=False))
        assert run(second, prefix + [2]) == run(plain, prefix + [2])
        assert tiers.num_shared_hits == 4 and second.counters.num_prefix_cache_hits == 64
        assert connect(server.url).zcard("t:kvblocks:tiny") <= 8  # the cap
