"""Cache-aware routing and warm-up on a live cluster (threads, real gRPC and Redis): requests sharing a long
system prompt reuse its KV (hit rate from the workers' metrics), go to the prefill worker that holds it, and
give the same output as stock ``generate``."""

from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.state.records import RequestStore
from common.state.redis_client import connect
from pdserve.client import Client
from tests.conftest import hf_greedy
from tests.services.inprocess import inprocess_cluster

PREFILLS = ("prefill-0", "prefill-1")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(model_dir):
    with inprocess_cluster(model_dir, prefill=[{"worker_id": w} for w in PREFILLS],
                           decode=[{"worker_id": "decode-0"}]) as c:
        yield c


def counters(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def post(address: str, path: str, body) -> dict:
    request = urllib.request.Request(f"http://{address}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def test_warmed_system_prompt_gives_a_high_hit_rate_and_equal_outputs(cluster, model_dir, hf_reference):
    rng = random.Random(5)
    system = [rng.randrange(10, 4000) for _ in range(1000)]
    for w in PREFILLS:  # the admin call; --warmup-file does the same at start
        assert post(cluster.metrics[w], "/admin/warmup", {"prompts": [system]}) == {
            "prompts": 1, "prompt_tokens": 1000, "pinned_blocks": 62}
    before = {w: counters(cluster.metrics[w]) for w in PREFILLS}
    assert all(before[w]["pdserve:kv_cache_blocks_cached"] >= 62 for w in PREFILLS)
    prompts = [system + [rng.randrange(10, 4000) for _ in range(8)] for _ in range(10)]
    with Client(cluster.router) as client:
        results = [client.generate(p, max_tokens=4, temperature=0.0, ignore_eos=True) for p in prompts]
    after = {w: counters(cluster.metrics[w]) for w in PREFILLS}

    def delta(name):
        return sum(after[w][name] - before[w][name] for w in PREFILLS)

    hit_rate = delta("pdserve:prefix_cache_hits_total") / delta("pdserve:prefix_cache_queries_total")
    assert hit_rate > 0.8, hit_rate  # 992 of 1008 tokens of every prompt
    hf = hf_reference(model_dir)
    for p, r in list(zip(prompts, results))[:3]:
        assert r.token_ids == hf_greedy(hf, p, 4)
    assert all(after[w]["pdserve:kv_cache_blocks_used"] == 0 for w in PREFILLS)  # pinned blocks count as cached


def test_requests_follow_the_worker_that_cached_their_prefix(cluster):
    rng = random.Random(6)
    system = [rng.randrange(10, 4000) for _ in range(400)]
    with Client(cluster.router) as client:
        first = client.generate(system + [11], max_tokens=2, temperature=0.0, ignore_eos=True)
        time.sleep(1.0)  # the worker publishes its prefix index every 0.2 s
        later = [client.generate(system + [12 + i], max_tokens=2, temperature=0.0, ignore_eos=True)
                 for i in range(4)]
    assert [r.prefill_worker_id for r in later] == [first.prefill_worker_id] * 4
    record = RequestStore(connect(cluster.redis_url)).get(later[-1].request_id)
    assert f"prefill {first.prefill_worker_id}: 400 of 401 prompt tokens cached there" in record.route_reason
