"""Multi-turn sessions and conditional disaggregation on a live cluster (threads, real gRPC and Redis):
a session's next turn goes to the decode worker holding its KV and only the new tokens are computed; short
prompts are prefilled on the decode worker; output always equals stock ``generate``."""

from __future__ import annotations

import json
import random
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.state.records import RequestStore, SessionStore
from common.state.redis_client import connect
from pdserve.client import Client
from tests.conftest import hf_greedy
from tests.services.inprocess import inprocess_cluster

THRESHOLD = 32


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(model_dir):
    with inprocess_cluster(model_dir, prefill=[{"worker_id": "prefill-0"}],
                           decode=[{"worker_id": "decode-0"}, {"worker_id": "decode-1"}],
                           router={"local_prefill_threshold": THRESHOLD}) as c:
        yield c


def counter(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_five_turns_reuse_the_conversation_kv_and_equal_generate(cluster, model_dir, hf_reference):
    hf = hf_reference(model_dir)
    rng = random.Random(3)
    history: list[int] = []
    decode_ids, prefill_ids = [], []
    prompt_tokens_on_prefill = counter(cluster.metrics["prefill-0"], "pdserve:prompt_tokens_total")
    hits = {w: counter(cluster.metrics[w], "pdserve:prefix_cache_hits_total") for w in ("decode-0", "decode-1")}
    with Client(cluster.router) as client:
        for turn in range(5):
            prompt = history + [rng.randrange(10, 4000) for _ in range(40 if turn == 0 else 7)]
            result = client.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True, session_id="conv-1")
            assert result.token_ids == hf_greedy(hf, prompt, 6), f"turn {turn}"
            decode_ids.append(result.decode_worker_id)
            prefill_ids.append(result.prefill_worker_id)
            history = prompt + result.token_ids
    assert prefill_ids == ["prefill-0", "", "", "", ""]  # later turns: prefilled where the KV is
    assert len(set(decode_ids)) == 1
    sticky = decode_ids[0]
    assert counter(cluster.metrics["prefill-0"], "pdserve:prompt_tokens_total") - prompt_tokens_on_prefill == 40
    reused = counter(cluster.metrics[sticky], "pdserve:prefix_cache_hits_total") - hits[sticky]
    assert reused >= 4 * 32  # each later turn found at least the first turn's 2 full blocks
    session = SessionStore(connect(cluster.redis_url)).get("conv-1")
    assert session.decode_worker_id == sticky and session.token_ids == history


def test_a_short_prompt_is_prefilled_on_the_decode_worker(cluster, model_dir, hf_reference):
    hf = hf_reference(model_dir)
    short, long = list(range(100, 110)), list(range(200, 200 + THRESHOLD))
    with Client(cluster.router) as client:
        a = client.generate(short, max_tokens=5, temperature=0.0, ignore_eos=True)
        b = client.generate(long, max_tokens=5, temperature=0.0, ignore_eos=True)
    assert (a.prefill_worker_id, b.prefill_worker_id) == ("", "prefill-0") and a.decode_worker_id
    assert a.token_ids == hf_greedy(hf, short, 5) and b.token_ids == hf_greedy(hf, long, 5)
    record = RequestStore(connect(cluster.redis_url)).get(a.request_id)
    assert f"--local-prefill-threshold {THRESHOLD}" in record.route_reason


def test_session_over_http_and_a_bad_session_id(cluster):
    models = json.loads(urllib.request.urlopen(f"http://{cluster.router_http}/v1/models", timeout=10).read())
    body = {"model": models["data"][0]["id"], "prompt": list(range(300, 340)), "max_tokens": 3,
            "temperature": 0.0, "session_id": "http-conv"}

    def post(body):
        request = urllib.request.Request(f"http://{cluster.router_http}/v1/completions",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    assert post(body)[0] == 200
    assert SessionStore(connect(cluster.redis_url)).get("http-conv") is not None
    status, error = post(body | {"session_id": "has space"})
    assert status == 400 and error["error"]["param"] == "session_id"
