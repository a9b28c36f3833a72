"""The real thing: ``pdserve up`` with 2 prefill and 2 decode worker processes, a router and Redis.

16 concurrent requests equal stock ``generate``; both workers of each pool serve some; afterwards no KV
block is used and no finished request's record outlives its TTL; bad input is INVALID_ARGUMENT naming the
value; a SIGKILLed worker leaves the registry within its TTL and new requests avoid it; Ctrl-C leaves no
process behind.
"""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import pytest
import redis as redis_lib
import torch

from pdserve.client import Client
from tests.cli import pdserve
from tests.conftest import hf_greedy
from tests.services.up import generate_concurrently, pdserve_up

HEARTBEAT_TTL_S = 3.0


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with pdserve_up("--model", model_dir, "--prefill", "2", "--decode", "2", "--log-dir",
                    str(tmp_path_factory.mktemp("up-logs")), "--worker-arg=--kv-cache-memory=6e7",
                    f"--worker-arg=--heartbeat-ttl-s={HEARTBEAT_TTL_S}", "--router-arg=--record-ttl-s=1") as info:
        yield info
    assert info["returncode"] == 0


def live_workers(redis_url: str) -> list[dict]:
    return json.loads(pdserve("status", "--json", "--redis-url", redis_url).stdout)["workers"]


def test_concurrent_requests_equal_generate_and_use_both_pools(cluster, model_dir, hf_reference):
    g = torch.Generator().manual_seed(7)
    lens = [1, 3, 9, 16, 17, 30, 45, 64, 80, 100, 120, 150, 180, 200, 250, 300]
    prompts = [torch.randint(4, 4096, (n,), generator=g).tolist() for n in lens]
    max_tokens = [4 + (i * 5) % 29 for i in range(len(prompts))]
    results, errors = generate_concurrently(cluster["router"], prompts, max_tokens)
    assert not errors, errors
    reference = hf_reference(model_dir)
    for i, prompt in enumerate(prompts):
        assert results[i].token_ids == hf_greedy(reference, prompt, max_tokens[i]), f"prompt {i} (len {len(prompt)})"
        assert results[i].finish_reason == "length" and results[i].completion_tokens == max_tokens[i]
    assert {r.prefill_worker_id for r in results.values()} == {"prefill-0", "prefill-1"}
    assert {r.decode_worker_id for r in results.values()} == {"decode-0", "decode-1"}


def test_nothing_left_behind_after_requests(cluster):
    deadline = time.monotonic() + 15
    while True:
        workers = live_workers(cluster["redis"])
        if all(w["kv_blocks_used"] == 0 for w in workers) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert len(workers) == 4
    assert all(w["kv_blocks_used"] == 0 and w["num_requests_running"] == 0 for w in workers), workers
    for w in workers:
        assert set(w) >= {"id", "role", "address", "host", "pid", "num_requests_running", "num_requests_waiting",
                          "kv_blocks_used", "kv_blocks_total"}
    r = redis_lib.Redis.from_url(cluster["redis"])
    deadline = time.monotonic() + 15
    while r.keys("pdserve:request:*") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert r.keys("pdserve:request:*") == []


def test_generate_cli_json(cluster, model_dir, hf_reference):
    from transformers import AutoTokenizer

    out = json.loads(pdserve("generate", "The class statement", "--router", cluster["router"], "--max-tokens", "9",
                             "--temperature", "0", "--ignore-eos", "--json").stdout)
    ids = AutoTokenizer.from_pretrained(model_dir)("The class statement")["input_ids"]
    assert out["token_ids"] == hf_greedy(hf_reference(model_dir), ids, 9)
    assert out["finish_reason"] == "length"
    assert out["prefill_worker_id"].startswith("prefill-") and out["decode_worker_id"].startswith("decode-")
    assert set(out) >= {"token_ids", "text", "finish_reason", "prefill_worker_id", "decode_worker_id"}


@pytest.mark.parametrize(
    "prompt, sampling, message",
    [
        ("", {}, "prompt is empty"),
        ([5] * 2048, {}, "2048 tokens"),
        ([5, 6], {"temperature": -1.0}, "-1"),
        ([5, 6], {"top_p": 0.0}, "top_p"),
        ([5, 6], {"stop_token_ids": [99999]}, "99999"),
        # Longer than the KV wire format carries: the hand-off used to fail with UNKNOWN.
        ([5, 6], {"request_id": "é" * 129}, "request_id must be at most 256 UTF-8 bytes, got 258"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_value(cluster, prompt, sampling, message):
    with Client(cluster["router"], timeout_s=30) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.generate(prompt, **sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_killed_worker_leaves_the_registry_and_is_avoided(cluster):
    victim = next(w for w in live_workers(cluster["redis"]) if w["id"] == "decode-1")
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + HEARTBEAT_TTL_S + 3
    while any(w["id"] == "decode-1" for w in live_workers(cluster["redis"])):
        assert time.monotonic() < deadline, "decode-1 still registered after its TTL"
        time.sleep(0.3)
    time.sleep(1.0)  # the router's view refreshes twice a second
    with Client(cluster["router"], timeout_s=60) as client:
        results = [client.generate([5, 6, 7, i], max_tokens=3, temperature=0.0) for i in range(4)]
    assert {r.decode_worker_id for r in results} == {"decode-0"}
