"""Hung workers (SIGSTOP: the process freezes, its sockets stay open, so nothing fails by itself) never hang
a request: keepalive pings fail a frozen peer's calls with UNAVAILABLE, so a request mid-stream moves to
another decode worker and a hand-off is retried on another pair; the frozen worker's registry entry lapses
and stops counting toward capacity; once resumed (SIGCONT) it re-registers with every block free. Real
processes (``pdserve up`` with 2 prefill and 2 decode workers)."""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest

from pdserve.client import Client, Result
from tests.conftest import hf_greedy
from tests.services.probe import metric, wait_for, workers
from tests.services.up import pdserve_up

HEARTBEAT_TTL_S = 3
SUSPECT_COOLDOWN_S = 1


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    with pdserve_up("--model", model_dir, "--prefill", "2", "--decode", "2", "--log-dir",
                    str(tmp_path_factory.mktemp("hung-logs")), "--worker-arg=--kv-cache-memory=6e7",
                    f"--worker-arg=--heartbeat-ttl-s={HEARTBEAT_TTL_S}",
                    f"--router-arg=--worker-cooldown-s={SUSPECT_COOLDOWN_S}") as info:  # short cool-down
        info["workers"] = workers(info["redis"])
        yield info


@contextmanager
def frozen(cluster, worker_id: str):
    """SIGSTOP a worker for the block; SIGCONT after, then wait until it is registered again, all blocks free.
    Before freezing, waits until the router itself counts every worker ready and no earlier failure makes one a
    suspect, so that requests do reach the victim (the router's view can lag a re-registration by a refresh)."""
    pid = cluster["workers"][worker_id].pid
    for role in ("prefill", "decode"):
        wait_for(lambda role=role: metric(cluster["http"], "pdserve:workers", role=role, state="ready") == 2, 15,
                 f"the router counts two ready {role} workers")
    time.sleep(SUSPECT_COOLDOWN_S + 0.5)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: worker_id in workers(cluster["redis"]), 15, f"{worker_id} registered again")
    wait_for(lambda: all(w.kv_blocks_used == 0 for w in workers(cluster["redis"]).values()), 15,
             "every KV block free on every worker")


def concurrent_generate(router: str, prompts: list[list[int]], max_tokens: int) -> list:
    """Generate every prompt at once (one thread each); a result, or the exception it raised."""
    out: list = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            with Client(router, timeout_s=90) as client:
                out[i] = client.generate(prompts[i], max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            out[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_a_frozen_decode_worker_mid_stream_costs_a_migration(cluster, model_dir, hf_reference):
    prompt = [(17 * i) % 3000 + 40 for i in range(36)]
    result, gaps = Result(), []
    with Client(cluster["router"], timeout_s=120) as client:
        last = time.monotonic()
        for i, piece in enumerate(client.stream(prompt, max_tokens=100, temperature=0.0, ignore_eos=True)):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            result.add(piece)
            if i == 10:
                victim = result.decode_worker_id
                os.kill(cluster["workers"][victim].pid, signal.SIGSTOP)
    try:
        assert result.migrations == 1 and result.decode_worker_id != victim
        assert result.token_ids == hf_greedy(hf_reference(model_dir), prompt, 100)  # nothing missing or repeated
        assert max(gaps) < 25, max(gaps)  # keepalive caught the frozen worker; the stream went on elsewhere
        # its entry lapsed: it counts neither as a worker nor toward the pool's capacity
        wait_for(lambda: victim not in workers(cluster["redis"]), 2 * HEARTBEAT_TTL_S, f"{victim} lapsed")
        http = cluster["http"]
        wait_for(lambda: metric(http, "pdserve:workers", role="decode", state="ready") == 1, 5,
                 "the router counts one ready decode worker")
    finally:
        os.kill(cluster["workers"][victim].pid, signal.SIGCONT)
    wait_for(lambda: victim in workers(cluster["redis"]), 15, f"{victim} registered again")
    wait_for(lambda: all(w.kv_blocks_used == 0 for w in workers(cluster["redis"]).values()), 15,
             "every KV block free on every worker")


@pytest.mark.parametrize("victim", ["decode-0", "prefill-0"])
def test_a_frozen_worker_costs_a_retry_not_a_hang(cluster, model_dir, hf_reference, victim):
    prompts = [[(5 * i + 3 * j) % 3000 + 20 for i in range(24 + 8 * j)] for j in range(4)]
    http = cluster["http"]
    retries_before = metric(http, "pdserve:handoff_retries_total")
    with frozen(cluster, victim):
        t0 = time.monotonic()
        results = concurrent_generate(cluster["router"], prompts, 64)  # long enough to overlap: the router
        # spreads overlapping requests by its in-flight counts, so at least one goes to the frozen worker
        took_s = time.monotonic() - t0
    hf = hf_reference(model_dir)
    for prompt, r in zip(prompts, results):
        assert not isinstance(r, Exception), r
        assert r.token_ids == hf_greedy(hf, prompt, 64)
        assert victim not in (r.prefill_worker_id, r.decode_worker_id)
    assert took_s < 40, took_s
    assert metric(http, "pdserve:handoff_retries_total") > retries_before  # at least one went to it first
