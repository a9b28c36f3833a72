"""A worker's security settings: pickle weights only with ``allow_pickle_weights``, a bad KV key file fails the
start, and a whole cluster runs on a Redis with a password over TLS with its shared KV tier encrypted (a tampered
block is counted and recomputed; the password shows in no log line)."""

from __future__ import annotations

import logging
import random
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.engine.loader import ModelLoadError
from common.engine.sampling_params import SamplingParams
from common.security.kv_crypto import KVCipher
from common.state.redis_client import connect
from pdserve.client import Client
from services.worker.config import WorkerConfig
from services.worker.runtime import attach_kv_tiers, build_engine
from tests.conftest import hf_greedy
from tests.pickle_checkpoint import pickle_copy
from tests.redis_server import TLS_UNSUPPORTED, tls_supported
from tests.services.inprocess import inprocess_cluster

PASSWORD = "cluster-s3cret"
KEY = bytes(range(100, 132))


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def test_pickle_weights_load_only_with_allow_pickle_weights(model_dir, hf_reference, tmp_path):
    pickled = str(pickle_copy(model_dir, tmp_path / "pickled"))
    with pytest.raises(ModelLoadError, match=r"\['pytorch_model.bin'\].*--allow-pickle-weights"):
        build_engine(WorkerConfig(model=pickled))
    config = WorkerConfig(model=pickled, allow_pickle_weights=True, kv_cache_memory=1e6, max_model_len=128)
    engine = build_engine(config)
    prompt = list(range(10, 30))
    [result] = engine.generate([prompt], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert result.token_ids == hf_greedy(hf_reference(model_dir), prompt, 4)


def test_a_bad_kv_key_file_fails_the_start_naming_it(model_dir, tmp_path):
    engine = build_engine(WorkerConfig(model=model_dir, kv_cache_memory=1e6, max_model_len=128))
    key_file = tmp_path / "short.key"
    key_file.write_bytes(b"0123")
    config = WorkerConfig(model=model_dir, kv_encryption_key_file=str(key_file))  # no tier: still checked
    with pytest.raises(ValueError, match=f"^KV encryption key file {key_file}: expected 32 raw bytes"):
        attach_kv_tiers(engine, None, config)
    assert engine.kv_tiers is None


def metric(address: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.skipif(not tls_supported(), reason=TLS_UNSUPPORTED)
def test_a_cluster_on_redis_with_password_and_tls_shares_encrypted_kv(model_dir, hf_reference, tmp_path, caplog):
    key_file = tmp_path / "kv.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    small = {"kv_cache_memory": 4e5, "max_model_len": 160, "max_num_seqs": 1, "kv_shared_cache_blocks": 64,
             "kv_encryption_key_file": str(key_file)}
    rng = random.Random(9)
    prefix = [rng.randrange(10, 4000) for _ in range(64)]
    reference = hf_reference(model_dir)

    def evict(client: Client) -> None:  # long prompts push the prefix out of the prefill worker's small cache
        for _ in range(2):
            client.generate([rng.randrange(10, 4000) for _ in range(140)], max_tokens=2, temperature=0.0,
                            ignore_eos=True)

    with caplog.at_level(logging.DEBUG), inprocess_cluster(
            model_dir, prefill=[{"worker_id": "prefill-0", **small}], decode=[{"worker_id": "decode-0"}],
            redis_options={"password": PASSWORD, "tls": True}) as cluster, Client(cluster.router) as client:
        assert cluster.redis_url.startswith(f"rediss://:{PASSWORD}@127.0.0.1:")
        prefill = cluster.metrics["prefill-0"]
        client.generate(prefix + [1], max_tokens=2, temperature=0.0, ignore_eos=True)
        evict(client)
        result = client.generate(prefix + [2], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert result.token_ids == hf_greedy(reference, prefix + [2], 4)
        assert metric(prefill, "pdserve:prefix_cache_tier_hits_total", tier="shared") == 4

        redis = connect(cluster.redis_url)
        keys = sorted(k.decode() for k in redis.scan_iter("pdserve:kvblock:*"))
        assert keys and all(f"-k{KVCipher(KEY).fingerprint}:" in k for k in keys)
        evict(client)  # the prefix is spilled again; now every stored block is tampered with
        for key in redis.scan_iter("pdserve:kvblock:*"):
            value = bytearray(redis.get(key))
            value[-1] ^= 0x01
            redis.set(key, bytes(value), keepttl=True)
        result = client.generate(prefix + [3], max_tokens=4, temperature=0.0, ignore_eos=True)
        assert result.token_ids == hf_greedy(reference, prefix + [3], 4)
        assert metric(prefill, "pdserve:kv_tier_integrity_failures_total") == 1  # the first block; lookup stops
        assert metric(prefill, "pdserve:prefix_cache_tier_hits_total", tier="shared") == 4  # none more
    assert "shared KV tier: dropped block pdserve:kvblock:" in caplog.text
    assert PASSWORD not in caplog.text and KEY.hex() not in caplog.text
