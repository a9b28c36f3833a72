"""SIGTERM on a worker (real processes, ``pdserve up``): readiness turns false at once, it leaves the
registry, its in-flight work finishes normally (a decode worker's stream without migration, a prefill
worker's prefill without a retry), it exits 0, and new requests go elsewhere."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from pdserve.client import Client, Result
from tests.cli import pdserve
from tests.conftest import hf_greedy
from tests.services.probe import metric, wait_for, workers
from tests.services.up import pdserve_up


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with pdserve_up("--model", model_dir, "--decode", "2", "--log-dir", str(tmp_path_factory.mktemp("drain-logs")),
                    "--worker-arg=--kv-cache-memory=6e7") as info:
        yield info


def readyz(address: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{address}/readyz", timeout=2) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return -1  # gone


def test_sigterm_drains_a_decode_worker_without_losing_its_stream(cluster, model_dir, hf_reference):
    workers = {w["id"]: w for w in json.loads(pdserve("status", "--json", "--redis-url", cluster["redis"]).stdout)[
        "workers"]}
    prompt = [(11 * i) % 3000 + 30 for i in range(30)]
    result = Result()
    with Client(cluster["router"], timeout_s=120) as client:
        for i, piece in enumerate(client.stream(prompt, max_tokens=150, temperature=0.0, ignore_eos=True)):
            result.add(piece)
            if i == 5:
                victim = workers[result.decode_worker_id]
                os.kill(victim["pid"], signal.SIGTERM)
                t0 = time.monotonic()
                while readyz(victim["metrics_address"]) != 503:
                    assert time.monotonic() - t0 < 2.0, "readiness did not turn false"
                    time.sleep(0.02)
        listed = [w["id"] for w in json.loads(pdserve("status", "--json", "--redis-url", cluster["redis"]).stdout)[
            "workers"]]
        assert victim["id"] not in listed  # deregistered, not left to expire
        assert (result.migrations, result.completion_tokens) == (0, 150)  # finished where it ran
        assert result.token_ids == hf_greedy(hf_reference(model_dir), prompt, 150)
        after = client.generate(prompt, max_tokens=3, temperature=0.0, ignore_eos=True)
        assert after.decode_worker_id not in ("", victim["id"])
    deadline = time.monotonic() + 30
    exit_line = f"{victim['id']} (pid {victim['pid']}) exited with code 0"
    while not any(exit_line in line for line in cluster["stderr"]):
        assert time.monotonic() < deadline, cluster["stderr"][-5:]
        time.sleep(0.1)


@pytest.fixture(scope="module")
def slow_prefill_cluster(model_dir, tmp_path_factory):
    with pdserve_up("--model", model_dir, "--prefill", "2", "--log-dir", str(tmp_path_factory.mktemp("drain-p-logs")),
                    "--worker-arg=--kv-cache-memory=6e7", "--prefill-arg=--prefill-chunk-size=2",
                    "--prefill-arg=--max-num-batched-tokens=2") as info:
        info["workers"] = workers(info["redis"])
        yield info


def test_sigterm_drains_a_prefill_worker_finishing_its_prefills(slow_prefill_cluster, model_dir, hf_reference):
    c = slow_prefill_cluster
    # ~950 engine steps of 2 tokens on the prefill worker (about two seconds of work left when the SIGTERM lands). With
    # 75 steps of 16 the prefill ended ~0.2 s after the kill, and a CI run once found the worker gone, drained,
    # before it saw /readyz say 503.
    prompt = [(7 * i) % 4000 + 4 for i in range(1900)]
    outcome: dict = {}
    retries_before = metric(c["http"], "pdserve:handoff_retries_total")
    with Client(c["router"], timeout_s=120) as client:
        thread = threading.Thread(target=lambda: outcome.update(
            result=client.generate(prompt, max_tokens=4, temperature=0.0, ignore_eos=True)))
        thread.start()
        prefills = [w for w in c["workers"].values() if w.role == "prefill"]
        busy = wait_for(lambda: next((w for w in prefills if metric(w.metrics_address, "pdserve:num_requests_running")),
                                     None), 30, "a prefill running", interval_s=0.01)
        os.kill(busy.pid, signal.SIGTERM)
        t0 = time.monotonic()
        while (code := readyz(busy.metrics_address)) != 503:
            assert code != -1, "the worker was gone before its readiness was seen false"
            assert time.monotonic() - t0 < 2.0, "readiness did not turn false"
            time.sleep(0.02)
        thread.join(120)
        # read before the next request: one routed while the router's view of the pool still lists the draining
        # worker is refused there and retried elsewhere, which is that request's business, not this one's
        retries_after = metric(c["http"], "pdserve:handoff_retries_total")
        assert busy.id not in workers(c["redis"])  # deregistered at once
        after = client.generate(prompt[:40], max_tokens=3, temperature=0.0, ignore_eos=True)
        assert after.prefill_worker_id not in ("", busy.id)
    result = outcome["result"]
    assert result.prefill_worker_id == busy.id  # finished where it ran: no retry
    assert retries_after == retries_before
    assert result.token_ids == hf_greedy(hf_reference(model_dir), prompt, 4)
    exit_line = f"{busy.id} (pid {busy.pid}) exited with code 0"
    wait_for(lambda: any(exit_line in line for line in c["stderr"]), 30, exit_line)
