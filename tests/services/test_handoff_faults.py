"""Faults at the prefill→decode hand-off, in an in-process cluster: never a hang, never a leak."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import grpc
import pytest

from common.state.redis_client import connect
from common.state.registry import WorkerRegistry
from pdserve.client import Client
from tests.conftest import hf_greedy
from tests.services.inprocess import inprocess_cluster


def wait_all_blocks_free(redis_url: str, timeout_s: float = 5.0) -> list:
    registry = WorkerRegistry(connect(redis_url))
    deadline = time.monotonic() + timeout_s
    while True:
        workers = registry.list_workers()
        if all(w.kv_blocks_used == 0 for w in workers) or time.monotonic() > deadline:
            return workers


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def test_corrupt_chunk_is_caught_and_the_request_retried_on_another_pair(model_dir, hf_reference):
    prefill = [{"worker_id": "prefill-bad", "test_corrupt_kv_chunk": 1}, {"worker_id": "prefill-good"}]
    with inprocess_cluster(model_dir, prefill=prefill, decode=[{"worker_id": "decode-0"}]) as cluster:
        with Client(cluster.router, timeout_s=60) as client:
            prompts = [[5 + i, 6, 7, 8, 9] * (3 + i) for i in range(4)]
            results = [client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True) for p in prompts]
        for p, r in zip(prompts, results):
            assert r.token_ids == hf_greedy(hf_reference(model_dir), p, 8)
            assert r.prefill_worker_id == "prefill-good" and r.finish_reason == "length"
        workers = wait_all_blocks_free(cluster.redis_url)
        assert {w.id for w in workers} == {"prefill-bad", "prefill-good", "decode-0"}
        assert all(w.kv_blocks_used == 0 for w in workers), [(w.id, w.kv_blocks_used) for w in workers]


def test_corrupt_chunk_without_a_healthy_pair_fails_clearly(model_dir):
    prefill = [{"worker_id": "prefill-bad", "test_corrupt_kv_chunk": 0}]
    with inprocess_cluster(model_dir, prefill=prefill, decode=[{"worker_id": "decode-0"}]) as cluster:
        with Client(cluster.router, timeout_s=60) as client:
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                client.generate([5, 6, 7, 8] * 10, max_tokens=8, temperature=0.0)
            assert time.monotonic() - t0 < 30
        assert err.value.code() == grpc.StatusCode.DATA_LOSS
        assert "checksum" in err.value.details().lower() and "prefill-bad" in err.value.details()
        workers = wait_all_blocks_free(cluster.redis_url)
        assert all(w.kv_blocks_used == 0 for w in workers), [(w.id, w.kv_blocks_used) for w in workers]


def test_workers_that_disagree_on_the_model_refuse_to_move_kv(model_dir, tiny_model_dir):
    other = tiny_model_dir("llama", seed=1)
    with inprocess_cluster(model_dir, prefill=[{"worker_id": "prefill-0", "model": other}],
                           decode=[{"worker_id": "decode-0"}], router={"max_retries": 0}) as cluster:
        with Client(cluster.router, timeout_s=60) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.generate([5, 6, 7], max_tokens=4)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "model_fingerprint" in err.value.details()
        assert all(w.kv_blocks_used == 0 for w in wait_all_blocks_free(cluster.redis_url))


def assert_three_prompts_as_stock(cluster, model_dir, hf_reference) -> None:
    """Three prompts of 15-135 tokens through the cluster: stock generate's tokens, every KV block free after."""
    with Client(cluster.router, timeout_s=60) as client:
        prompts = [[7 + i, 8, 9] * (5 + 20 * i) for i in range(3)]
        results = [client.generate(p, max_tokens=6, temperature=0.0, ignore_eos=True) for p in prompts]
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(hf_reference(model_dir), p, 6)
    assert all(w.kv_blocks_used == 0 for w in wait_all_blocks_free(cluster.redis_url))


def test_shared_memory_transport_on_the_same_host(model_dir, hf_reference, monkeypatch):
    import services.prefill.servicer as prefill_servicer

    def no_grpc(*args, **kwargs):
        raise AssertionError("the gRPC KV sender must not be used when shared memory is available")

    monkeypatch.setattr(prefill_servicer, "GrpcKVSender", no_grpc)
    prefill = [{"worker_id": "prefill-0", "kv_transport": "shm"}]
    with inprocess_cluster(model_dir, prefill=prefill, decode=[{"worker_id": "decode-0"}]) as cluster:
        assert_three_prompts_as_stock(cluster, model_dir, hf_reference)


@pytest.mark.parametrize("blocks", ["1", "0"], ids=["direct-blocks", "arenas"])
def test_nixl_transport(model_dir, hf_reference, monkeypatch, blocks):
    """Prefill with --kv-transport nixl, decode with --kv-nixl: the KV goes by NIXL writes (never gRPC), straight
    into the reserved blocks (or through arenas with PDSERVE_NIXL_BLOCKS=0: never the other way), the tokens are
    stock generate's, and the transfers are counted under transport="nixl"."""
    from common.kv_transfer import nixl, nixl_blocks

    if nixl.nixl_api() is None:
        pytest.skip(nixl.unavailable_reason())
    import services.prefill.servicer as prefill_servicer

    def refuse(what: str):
        def fail(*args, **kwargs):
            raise AssertionError(f"the {what} must not be used here")

        return fail

    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv(nixl_blocks.BLOCKS_ENV, blocks)
    monkeypatch.setattr(prefill_servicer, "GrpcKVSender", refuse("gRPC KV sender"))
    if blocks == "1":
        monkeypatch.setattr(prefill_servicer, "NixlKVSender", refuse("NIXL arena sender"))
    else:
        monkeypatch.setattr(nixl_blocks.NixlBlockSender, "__init__", refuse("NIXL block sender"))
    prefill = [{"worker_id": "prefill-0", "kv_transport": "nixl"}]
    decode = [{"worker_id": "decode-0", "kv_nixl": True, "kv_shm": False}]
    with inprocess_cluster(model_dir, prefill=prefill, decode=decode) as cluster:
        assert_three_prompts_as_stock(cluster, model_dir, hf_reference)
        metrics = urllib.request.urlopen(f"http://{cluster.metrics['prefill-0']}/metrics", timeout=5).read().decode()
        assert 'pdserve:kv_transfer_seconds_count{transport="nixl"} 3.0' in metrics
        placement = "contiguous" if blocks == "1" else "lru"  # --kv-block-placement auto: contiguous for block writes
        for worker in ("prefill-0", "decode-0"):
            health = json.loads(urllib.request.urlopen(f"http://{cluster.metrics[worker]}/healthz", timeout=5).read())
            assert health["kv_block_placement"] == placement, (worker, health)
            assert health["weight_layout"] == worker.split("-")[0], (worker, health)  # --weight-layout auto
        if blocks == "1":  # the decode worker counts what landed in its blocks: the payload, as prefill's sent
            decode = urllib.request.urlopen(f"http://{cluster.metrics['decode-0']}/metrics", timeout=5).read().decode()
            sent = re.search(r'pdserve:kv_transfer_bytes_total\{direction="sent"\} (\S+)', metrics).group(1)
            received = re.search(r'pdserve:kv_transfer_bytes_total\{direction="received"\} (\S+)', decode).group(1)
            assert float(sent) > 0 and sent == received


def test_seeded_sampling_through_the_cluster_equals_one_engine(model_dir):
    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.engine.loader import load_model
    from common.engine.sampling_params import SamplingParams

    prompts = [[5, 6, 7, 8] * 3, [9, 10] * 40]
    engine = LLMEngine(load_model(model_dir), EngineConfig(num_kv_blocks=200))
    expected = engine.generate(prompts, [SamplingParams(max_new_tokens=12, temperature=0.9, top_k=50, seed=s,
                                                        ignore_eos=True) for s in (11, 12)])
    with inprocess_cluster(model_dir, prefill=[{"worker_id": "prefill-0"}], decode=[{"worker_id": "decode-0"}]) as c:
        with Client(c.router, timeout_s=60) as client:
            got = [client.generate(p, max_tokens=12, temperature=0.9, top_k=50, seed=s, ignore_eos=True)
                   for p, s in zip(prompts, (11, 12))]
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert [g.text for g in got] == [e.text for e in expected]


def test_a_prefill_the_worker_cancels_is_retried_on_another_worker(model_dir, hf_reference, monkeypatch):
    """A worker whose server stops with a prefill in flight (a drain that ran out) cancels the call: the router did
    not cancel it, so it is retried like an unreachable worker, not passed to the client as CANCELLED."""
    from services.prefill.servicer import PrefillServicer

    real, cancelled = PrefillServicer.Prefill, []

    def cancel_the_first(self, request, context):
        if not cancelled:
            cancelled.append(request.request_id)
            context.abort(grpc.StatusCode.CANCELLED, "the server stopped")
        return real(self, request, context)

    monkeypatch.setattr(PrefillServicer, "Prefill", cancel_the_first)
    prefill = [{"worker_id": "prefill-0"}, {"worker_id": "prefill-1"}]
    with inprocess_cluster(model_dir, prefill=prefill, decode=[{"worker_id": "decode-0"}]) as cluster:
        with Client(cluster.router, timeout_s=60) as client:
            prompt = [5, 6, 7, 8, 9] * 4
            result = client.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert cancelled and result.token_ids == hf_greedy(hf_reference(model_dir), prompt, 8)
        workers = wait_all_blocks_free(cluster.redis_url)
        assert all(w.kv_blocks_used == 0 for w in workers), [(w.id, w.kv_blocks_used) for w in workers]
