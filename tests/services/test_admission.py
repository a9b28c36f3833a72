"""Admission control: workers hold a bounded number of requests; a saturated cluster answers
RESOURCE_EXHAUSTED (gRPC, with a ``retry-after-ms`` hint) or 429 (HTTP, with ``Retry-After``) at once
instead of queueing without bound, and the requests it did take finish normally."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve.client import Client
from tests.services.inprocess import inprocess_cluster


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    limits = {"max_pending_requests": 1, "max_num_seqs": 1}
    with inprocess_cluster(tiny_model_dir("llama"), prefill=[{"worker_id": "prefill-0", **limits}],
                           decode=[{"worker_id": "decode-0", **limits}], router={"retry_after_s": 2.0}) as c:
        yield c


def test_a_saturated_cluster_says_when_to_come_back(cluster):
    with Client(cluster.router, timeout_s=60) as client:
        busy = client.stream_call([5, 6, 7], max_tokens=400, temperature=0.0, ignore_eos=True)
        first = next(busy)  # admitted: it holds the only decode slot
        assert first.token_ids
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            client.generate([8, 9], max_tokens=4)
        assert time.monotonic() - t0 < 5  # answered at once, not queued behind the busy request
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "decode worker full" in err.value.details() and "retry after 2000 ms" in err.value.details()
        assert dict(err.value.trailing_metadata())["retry-after-ms"] == "2000"

        models = json.loads(urllib.request.urlopen(f"http://{cluster.router_http}/v1/models", timeout=10).read())
        body = json.dumps({"model": models["data"][0]["id"], "prompt": [8, 9], "max_tokens": 4}).encode()
        request = urllib.request.Request(f"http://{cluster.router_http}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(request, timeout=30)
        assert http_err.value.code == 429 and http_err.value.headers["Retry-After"] == "2"
        assert json.loads(http_err.value.read())["error"]["type"] == "rate_limit_error"

        assert sum(len(m.token_ids) for m in busy) + len(first.token_ids) == 400  # the admitted one finishes
        deadline = time.monotonic() + 10
        while True:  # and once it is done, the cluster takes requests again
            try:
                assert len(client.generate([8, 9], max_tokens=4, ignore_eos=True).token_ids) == 4
                break
            except grpc.RpcError as exc:
                assert exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.1)


def test_concurrent_burst_gets_results_or_fast_refusals_never_a_hang(cluster):
    outcomes: list[str] = []

    def one(i: int) -> None:
        with Client(cluster.router, timeout_s=60) as client:
            try:
                client.generate([5 + i, 6], max_tokens=30, temperature=0.0, ignore_eos=True)
                outcomes.append("ok")
            except grpc.RpcError as exc:
                outcomes.append(exc.code().name)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(outcomes) == 8 and set(outcomes) <= {"ok", "RESOURCE_EXHAUSTED"} and "ok" in outcomes
