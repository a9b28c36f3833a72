"""SIGTERM on a worker (real processes, ``pdserve up``): readiness turns false at once, it leaves the
registry, its in-flight stream finishes normally (no migration), it exits 0, and new requests go elsewhere."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

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
