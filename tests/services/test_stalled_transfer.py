"""A KV transfer that stalls mid-way (the prefill worker's stream stops after its first chunk and stays open):
the router gives the prefill no longer than the KV reservation's lease, both sides free their blocks, and the
request is retried once on another pair or fails with DEADLINE_EXCEEDED saying what stalled; never a hang.
In-process cluster (threads, real gRPC and Redis), where one worker can carry the test-only stall."""

from __future__ import annotations

import time

import grpc
import pytest

from pdserve.client import Client
from tests.conftest import hf_greedy
from tests.services.inprocess import inprocess_cluster
from tests.services.probe import metric, wait_for, workers

LEASE_S = 3.0


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def all_blocks_free(redis_url: str) -> bool:
    return all(w.kv_blocks_used == 0 for w in workers(redis_url).values())


def test_stalled_transfer_is_retried_on_another_pair(model_dir, hf_reference):
    # "prefill-a-stalls" sorts first: a fresh router sends its first request there
    prefill = [{"worker_id": "prefill-a-stalls", "test_stall_kv_chunk": 1}, {"worker_id": "prefill-b"}]
    with inprocess_cluster(model_dir, prefill=prefill, decode=[{"worker_id": "decode-0"}],
                           router={"kv_lease_s": LEASE_S}) as cluster:
        prompt = [(7 * i) % 3000 + 11 for i in range(50)]
        with Client(cluster.router, timeout_s=60) as client:
            t0 = time.monotonic()
            result = client.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
            took_s = time.monotonic() - t0
        assert result.token_ids == hf_greedy(hf_reference(model_dir), prompt, 8)
        assert result.prefill_worker_id == "prefill-b"
        assert LEASE_S <= took_s < LEASE_S + 10, took_s  # the lease bounded the stalled attempt
        assert metric(cluster.router_http, "pdserve:handoff_retries_total", code="DEADLINE_EXCEEDED") == 1
        # the stalled sender gave up and freed its blocks; the decode worker freed the partial reservation
        wait_for(lambda: all_blocks_free(cluster.redis_url), 10, "KV blocks freed on every worker")
        assert metric(cluster.metrics["prefill-a-stalls"], "pdserve:kv_cache_blocks_used") == 0
        assert metric(cluster.metrics["decode-0"], "pdserve:kv_cache_blocks_used") == 0


def test_stalled_transfer_without_another_pair_fails_with_deadline_exceeded(model_dir):
    prefill = [{"worker_id": "prefill-stalls", "test_stall_kv_chunk": 1}]
    with inprocess_cluster(model_dir, prefill=prefill, decode=[{"worker_id": "decode-0"}],
                           router={"kv_lease_s": LEASE_S}) as cluster:
        with Client(cluster.router, timeout_s=60) as client:
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                client.generate([5, 6, 7, 8] * 12, max_tokens=8, temperature=0.0)
            took_s = time.monotonic() - t0
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        details = err.value.details()
        assert "prefill-stalls" in details and "lease" in details and "stalled" in details, details
        assert "no other worker pair" in details
        assert took_s < LEASE_S + 10, took_s
        wait_for(lambda: all_blocks_free(cluster.redis_url), 10, "KV blocks freed on both workers")
