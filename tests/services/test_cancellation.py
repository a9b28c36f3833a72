"""A request cancelled while its prompt is still being computed stops on the prefill worker and frees the
decode worker's reservation at once; a cluster without workers answers 503 / UNAVAILABLE."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.client import Client
from tests.services.inprocess import inprocess_cluster


def gauge(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@pytest.fixture(scope="module")
def slow_prefill_cluster(tiny_model_dir):
    slow = {"prefill_chunk_size": 16, "max_num_batched_tokens": 16}  # a long prompt takes many steps
    with inprocess_cluster(tiny_model_dir("llama"), prefill=[{"worker_id": "prefill-0", **slow}],
                           decode=[{"worker_id": "decode-0"}]) as c:
        yield c


def test_cancel_during_prefill_stops_it_and_frees_both_workers(slow_prefill_cluster):
    c = slow_prefill_cluster
    prompt = [(7 * i) % 4000 + 4 for i in range(1800)]
    with Client(c.router, timeout_s=120) as client:
        call = client.stream_call(prompt, max_tokens=4, temperature=0.0)
        deadline = time.monotonic() + 20
        while gauge(c.metrics["prefill-0"], "pdserve:num_requests_running") == 0:  # prefill under way
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert gauge(c.metrics["decode-0"], "pdserve:kv_cache_blocks_used") > 0  # the reservation
        t0 = time.monotonic()
        call.cancel()
        while any(gauge(c.metrics[w], name) for w in ("prefill-0", "decode-0")
                  for name in ("pdserve:kv_cache_blocks_used", "pdserve:num_requests_running")):
            assert time.monotonic() - t0 < 1.0, "KV or requests still held 1 s after the cancel"
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() is grpc.StatusCode.CANCELLED


@pytest.fixture(scope="module")
def empty_cluster(tiny_model_dir):
    with inprocess_cluster(tiny_model_dir("llama"), prefill=[], decode=[]) as c:
        yield c


def test_no_workers_is_503_and_unavailable(empty_cluster):
    c = empty_cluster
    models = json.loads(urllib.request.urlopen(f"http://{c.router_http}/v1/models", timeout=10).read())
    body = json.dumps({"model": models["data"][0]["id"], "prompt": "hi", "max_tokens": 2}).encode()
    request = urllib.request.Request(f"http://{c.router_http}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 503 and "no live decode worker" in json.loads(err.value.read())["error"]["message"]
    with Client(c.router) as client, pytest.raises(grpc.RpcError) as rpc_err:
        client.generate("hi", max_tokens=2)
    assert rpc_err.value.code() is grpc.StatusCode.UNAVAILABLE
    with pytest.raises(urllib.error.HTTPError) as ready:  # and readiness says why
        urllib.request.urlopen(f"http://{c.router_http}/readyz", timeout=10)
    assert ready.value.code == 503 and "no ready decode worker" in ready.value.read().decode()
