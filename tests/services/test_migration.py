"""A decode worker killed (SIGKILL) mid-stream: the router moves the request to another decode worker, which
re-prefills the prompt and the tokens already sent; the client sees one stream, nothing missing or repeated,
equal to stock ``generate`` (real processes: ``pdserve up`` with 2 decode workers)."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest

from pdserve.client import Client, Result
from tests.cli import pdserve
from tests.conftest import hf_greedy
from tests.services.up import pdserve_up


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with pdserve_up("--model", model_dir, "--decode", "2", "--log-dir", str(tmp_path_factory.mktemp("migration-logs")),
                    "--worker-arg=--kv-cache-memory=6e7", "--worker-arg=--heartbeat-ttl-s=3") as info:
        yield info


def test_killed_decode_worker_mid_stream_costs_a_migration_not_a_failure(cluster, model_dir, hf_reference):
    prompt = [(13 * i) % 3000 + 20 for i in range(40)]
    workers = {w["id"]: w for w in json.loads(pdserve("status", "--json", "--redis-url", cluster["redis"]).stdout)[
        "workers"]}
    result = Result()
    with Client(cluster["router"], timeout_s=120) as client:
        for i, piece in enumerate(client.stream(prompt, max_tokens=120, temperature=0.0, ignore_eos=True)):
            result.add(piece)
            if i == 10:  # mid-stream: kill the decode worker serving it
                os.kill(workers[result.decode_worker_id]["pid"], signal.SIGKILL)
                killed = result.decode_worker_id
    assert result.migrations == 1 and result.decode_worker_id != killed
    assert result.finish_reason == "length" and result.completion_tokens == 120
    assert result.token_ids == hf_greedy(hf_reference(model_dir), prompt, 120)  # nothing missing or repeated
    out = pdserve("generate", "The class", "--router", cluster["router"], "--max-tokens", "4", "--json").stdout
    assert json.loads(out)["migrations"] == 0


LONG_PROMPT = [(7 * i) % 4000 + 4 for i in range(1500)]  # ~100 engine steps of 16 tokens on the prefill worker
PREFILL_KILL_ARGS = ("--prefill", "2", "--worker-arg=--kv-cache-memory=6e7", "--worker-arg=--heartbeat-ttl-s=3",
                     "--prefill-arg=--prefill-chunk-size=16", "--prefill-arg=--max-num-batched-tokens=16")


@pytest.fixture(scope="module")
def two_prefill_cluster(model_dir, tmp_path_factory):
    with pdserve_up("--model", model_dir, "--log-dir", str(tmp_path_factory.mktemp("prefill-kill-logs")),
                    *PREFILL_KILL_ARGS) as info:  # fmt: skip
        yield info


def test_killed_prefill_worker_mid_prefill_is_retried_on_the_other(two_prefill_cluster, model_dir, hf_reference):
    kill_the_busy_prefill_worker(two_prefill_cluster, model_dir, hf_reference)


def test_killed_prefill_worker_mid_nixl_block_transfer_is_retried_and_its_blocks_come_back(model_dir, hf_reference,
                                                                                          tmp_path_factory):
    """KV by NIXL block writes: the killed worker had claimed the decode worker's reserved blocks, which stay held
    (it might still write) until the grant ends (lease + 10 s), then come back; the retry succeeds meanwhile."""
    import time

    from common.kv_transfer import nixl
    from tests.services.probe import metric, wait_for, workers

    if nixl.nixl_api() is None:
        pytest.skip(nixl.unavailable_reason())
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # the workers' UCX on the loopback device only
    with pdserve_up("--model", model_dir, "--log-dir", str(tmp_path_factory.mktemp("prefill-kill-nixl-logs")),
                    *PREFILL_KILL_ARGS, "--prefill-arg=--kv-transport=nixl", "--decode-arg=--kv-nixl",
                    "--router-arg=--kv-lease-s=10") as c:  # fmt: skip
        started = time.monotonic()
        kill_the_busy_prefill_worker(c, model_dir, hf_reference)
        retried_s = time.monotonic() - started
        (decode,) = [w for w in workers(c["redis"]).values() if w.role == "decode"]

        def blocks_used() -> float:
            return metric(decode.metrics_address, "pdserve:kv_cache_blocks_used")

        # the retry's blocks go as it ends; the killed sender's claimed ones stay until the grant's end
        held = -(-len(LONG_PROMPT) // 16)  # the first reservation's blocks (block size 16)
        assert wait_for(lambda: blocks_used() == held, 5, "only the held reservation's blocks left"), retried_s
        wait_for(lambda: blocks_used() == 0, 45, "the held blocks freed")
        assert time.monotonic() - started > 10.0  # not before the lease of 10 s (+ the grace)


def kill_the_busy_prefill_worker(c: dict, model_dir, hf_reference) -> None:
    """SIGKILL the prefill worker computing a long prompt mid-prefill: the router retries it on the other one."""
    import time
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    workers = json.loads(pdserve("status", "--json", "--redis-url", c["redis"]).stdout)["workers"]
    prefills = [w for w in workers if w["role"] == "prefill"]

    def running(w) -> float:
        text = urllib.request.urlopen(f"http://{w['metrics_address']}/metrics", timeout=5).read().decode()
        return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "pdserve:num_requests_running")

    prompt = LONG_PROMPT
    outcome: dict = {}
    with Client(c["router"], timeout_s=120) as client:
        thread = threading.Thread(target=lambda: outcome.update(
            result=client.generate(prompt, max_tokens=4, temperature=0.0, ignore_eos=True)))
        thread.start()
        deadline = time.monotonic() + 30
        busy = None
        while busy is None and time.monotonic() < deadline:
            busy = next((w for w in prefills if running(w)), None)
            time.sleep(0.01)
        assert busy is not None, "the prefill never started"
        os.kill(busy["pid"], signal.SIGKILL)
        thread.join(120)
    result = outcome["result"]
    assert result.prefill_worker_id not in ("", busy["id"])
    assert result.token_ids == hf_greedy(hf_reference(model_dir), prompt, 4)
