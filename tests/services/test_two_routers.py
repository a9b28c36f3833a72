"""Two routers over one Redis (real processes): either serves any request with the same output; killing one
(SIGKILL) loses only its own open streams, whose KV the workers free, while the other's streams go on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.cluster.net import free_port, wait_for_grpc_health
from pdserve.client import Client
from tests.cli import REPO, pdserve
from tests.services.up import pdserve_up


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    model_dir = tiny_model_dir("llama")
    with pdserve_up("--model", model_dir, "--log-dir", str(tmp_path_factory.mktemp("two-routers-logs")),
                    "--worker-arg=--kv-cache-memory=6e7") as info:
        port = free_port()
        second = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "router", "--model", model_dir, "--port", str(port), "--http-port",
             str(free_port()), "--redis-url", info["redis"]],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        info["second"], info["second_proc"] = f"127.0.0.1:{port}", second
        try:
            assert wait_for_grpc_health(info["second"], timeout_s=60)
            yield info
        finally:
            second.kill()


def kv_blocks_used(cluster) -> float:
    workers = json.loads(pdserve("status", "--json", "--redis-url", cluster["redis"]).stdout)["workers"]
    total = 0.0
    for w in workers:
        text = urllib.request.urlopen(f"http://{w['metrics_address']}/metrics", timeout=5).read().decode()
        total += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                     if s.name == "pdserve:kv_cache_blocks_used")
    return total


def test_either_router_serves_and_killing_one_costs_only_its_streams(cluster):
    prompt = [(17 * i) % 3000 + 40 for i in range(24)]
    with Client(cluster["router"], timeout_s=120) as one, Client(cluster["second"], timeout_s=120) as two:
        deadline = time.monotonic() + 10
        while True:  # the second router reads the registry within its refresh interval
            try:
                b = two.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        a = one.generate(prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert a.token_ids == b.token_ids and len(a.token_ids) == 8

        survivor = one.stream(prompt, max_tokens=300, temperature=0.0, ignore_eos=True)
        doomed = two.stream(prompt, max_tokens=300, temperature=0.0, ignore_eos=True)
        next(survivor), next(doomed)
        cluster["second_proc"].kill()
        with pytest.raises(grpc.RpcError) as err:
            list(doomed)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert sum(len(p.token_ids) for p in survivor) == 299  # the other router's stream is untouched
    deadline = time.monotonic() + 15  # at most the decode worker's admission window (10 s) and a tick
    while kv_blocks_used(cluster):  # the dead router's calls ended: the workers freed its blocks
        assert time.monotonic() < deadline, "KV of the dead router's stream is still held"
        time.sleep(0.1)


def test_sigterm_on_a_router_finishes_its_streams_and_exits_0(cluster, tiny_model_dir):
    port, http_port = free_port(), free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "router", "--model", tiny_model_dir("llama"), "--port", str(port),
         "--http-port", str(http_port), "--redis-url", cluster["redis"], "--registry-refresh-s", "0.1"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert wait_for_grpc_health(f"127.0.0.1:{port}", timeout_s=60)
        prompt = [(19 * i) % 3000 + 50 for i in range(20)]
        with Client(f"127.0.0.1:{port}", timeout_s=60) as client:
            deadline = time.monotonic() + 10
            while True:  # until its registry view lists the workers
                try:
                    # long enough to outlast the checks below however fast the tiny model decodes
                    stream = client.stream(prompt, max_tokens=1000, temperature=0.0, ignore_eos=True)
                    first = next(stream)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
            router.send_signal(signal.SIGTERM)
            ready, until = 200, time.monotonic() + 10
            while ready == 200 and time.monotonic() < until:  # until it has taken the signal
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=2)
                except urllib.error.HTTPError as exc:
                    ready = exc.code
                time.sleep(0.05)
            assert ready == 503  # not ready while it drains
            assert len(first.token_ids) + sum(len(p.token_ids) for p in stream) == 1000  # finished, not cut
        assert router.wait(30) == 0
    finally:
        router.kill()
