"""The shared KV tier with encryption at rest: Redis holds only sealed blocks, a tampered block is dropped and
recomputed (outputs still equal stock ``generate``), and engines with another key or none never see the blocks."""

from __future__ import annotations

import random

import pytest

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.kv_tiers import KVTiers, RedisKVStore
from common.engine.loader import load_model
from common.engine.prefix_cache import block_hashes
from common.engine.sampling_params import SamplingParams
from common.security.kv_crypto import OVERHEAD_BYTES, KVCipher
from common.state.redis_client import connect
from tests.conftest import hf_greedy
from tests.redis_server import RedisServer

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
CIPHER = KVCipher(bytes(range(32)))


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_model(model_dir)


@pytest.fixture
def server():
    with RedisServer() as s:
        yield s


def engine_with_store(loaded, url: str, cipher: KVCipher | None) -> tuple[LLMEngine, KVTiers, RedisKVStore]:
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=10, max_model_len=150, max_num_seqs=1))
    spec = engine.kv_spec
    shape = (spec.num_layers, 2, spec.num_kv_heads, spec.block_size, spec.head_dim)
    store = RedisKVStore(connect(url), prefix="t:", space="tiny", shape=shape, dtype=spec.dtype, ttl_s=60,
                         max_blocks=8, cipher=cipher)
    tiers = KVTiers(host_blocks=0, shared=store)
    engine.attach_kv_tiers(tiers)
    return engine, tiers, store


def run(engine: LLMEngine, prompt: list[int]) -> list[int]:
    [result] = engine.generate([prompt], GREEDY)
    return result.token_ids


def spill_prefix(loaded, url: str, prefix: list[int], rng: random.Random) -> RedisKVStore:
    """An engine computes ``prefix``, then a long prompt evicts its 4 full blocks into the shared tier."""
    first, _, store = engine_with_store(loaded, url, CIPHER)
    run(first, prefix + [1])
    run(first, [rng.randrange(4, 4000) for _ in range(140)])
    return store


def test_redis_holds_only_sealed_blocks_in_a_key_space_named_by_the_key(loaded, server):
    rng = random.Random(8)
    prefix = [rng.randrange(4, 4000) for _ in range(64)]
    store = spill_prefix(loaded, server.url, prefix, rng)
    assert store.space == f"tiny-k{CIPHER.fingerprint}"
    redis = connect(server.url)
    names = block_hashes(prefix, 16)
    assert len(names) == 4
    for name in names:
        key = store.key(name)
        assert key == f"t:kvblock:tiny-k{CIPHER.fingerprint}:{name.hex()}"
        sealed = redis.get(key)
        assert len(sealed) == store.nbytes + OVERHEAD_BYTES
        plain = CIPHER.open(key.encode(), sealed)
        assert len(plain) == store.nbytes and plain[:64] not in sealed and plain[-64:] not in sealed
    # Another key, or none, reads nothing: other key spaces (and a moved value would fail authentication).
    _, _, other = engine_with_store(loaded, server.url, KVCipher(bytes(32)))
    _, _, plain_store = engine_with_store(loaded, server.url, None)
    assert other.get_run(names) == [] and plain_store.get_run(names) == []
    assert other.num_integrity_failures == 0


def test_a_tampered_block_is_deleted_counted_and_recomputed(loaded, model_dir, hf_reference, server, caplog):
    rng = random.Random(8)
    prefix = [rng.randrange(4, 4000) for _ in range(64)]
    store = spill_prefix(loaded, server.url, prefix, rng)
    redis = connect(server.url)
    names = block_hashes(prefix, 16)
    tampered = store.key(names[1])
    sealed = bytearray(redis.get(tampered))
    sealed[OVERHEAD_BYTES + 100] ^= 0x01
    redis.set(tampered, bytes(sealed))

    second, tiers, second_store = engine_with_store(loaded, server.url, CIPHER)
    with caplog.at_level("WARNING", logger="common.engine.kv_tiers"):
        out = run(second, prefix + [2])
    assert out == hf_greedy(hf_reference(model_dir), prefix + [2], 8)
    assert tiers.num_shared_hits == 1 and second.counters.num_prefix_cache_hits == 16  # block 0 only
    assert second_store.num_integrity_failures == tiers.num_integrity_failures == 1
    assert redis.exists(tampered) == 0 and redis.zscore(f"t:kvblocks:{store.space}", names[1].hex()) is None
    [record] = [r for r in caplog.records if r.name == "common.engine.kv_tiers"]
    assert record.getMessage().startswith(f"shared KV tier: dropped block {tampered}: sealed KV block of ")
    assert bytes(range(32)).hex() not in caplog.text


def test_a_block_copied_under_another_name_is_refused(loaded, server):
    rng = random.Random(3)
    prefix = [rng.randrange(4, 4000) for _ in range(64)]
    store = spill_prefix(loaded, server.url, prefix, rng)
    redis = connect(server.url)
    names = block_hashes(prefix, 16)
    redis.set(store.key(names[0]), redis.get(store.key(names[2])))  # block 2's valid value as block 0
    _, tiers, reader = engine_with_store(loaded, server.url, CIPHER)
    assert tiers.get_run(names) == []
    assert reader.num_integrity_failures == 1 and redis.exists(store.key(names[0])) == 0
    assert len(reader.get_run(names[1:])) == 3  # the untouched blocks are still served
