"""The shared KV tier on a live cluster: a prefix evicted from one prefill worker's cache is found in Redis by
whichever worker serves it next, and the output still equals stock ``generate``."""

from __future__ import annotations

import random
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import Client
from tests.conftest import hf_greedy
from tests.services.inprocess import inprocess_cluster

PREFILLS = ("prefill-0", "prefill-1")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(model_dir):
    small = {"kv_cache_memory": 4e5, "max_model_len": 160, "max_num_seqs": 1, "kv_shared_cache_blocks": 256}
    with inprocess_cluster(model_dir, prefill=[{"worker_id": w, **small} for w in PREFILLS],
                           decode=[{"worker_id": "decode-0"}]) as c:
        yield c


def tier_hits(address: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pdserve:prefix_cache_tier_hits_total" and s.labels["tier"] == "shared")


def test_an_evicted_prefix_is_shared_through_redis(cluster, model_dir, hf_reference):
    rng = random.Random(9)
    prefix = [rng.randrange(10, 4000) for _ in range(64)]
    with Client(cluster.router) as client:
        client.generate(prefix + [1], max_tokens=2, temperature=0.0, ignore_eos=True)
        for _ in range(6):  # other long prompts on both workers push the prefix out of their small caches
            client.generate([rng.randrange(10, 4000) for _ in range(140)], max_tokens=2, temperature=0.0,
                            ignore_eos=True)
        result = client.generate(prefix + [2], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert result.token_ids == hf_greedy(hf_reference(model_dir), prefix + [2], 4)
    assert sum(tier_hits(cluster.metrics[w]) for w in PREFILLS) == 4  # the prefix's 4 full blocks
