"""Chaos: a bounded load (200 requests, more for up to 2 minutes until 5 workers were killed; 8 at a time, mixed
lengths) while workers are killed (SIGKILL, now and then SIGTERM) and replaced at random. Every request must
complete with output equal to stock ``generate`` or fail with a clear status; migrations are counted;
afterwards no KV block is in use, no request record outlives its TTL and no process is left behind. Real
processes: ``pdserve up`` (2 prefill, 2 decode) on a Redis of the test's own, plus the replacement workers the
test starts. Prints the figures; ``PDSERVE_CHAOS_SEED`` replays a run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common.state.redis_client import connect
from pdserve.client import Client
from tests.cli import REPO
from tests.conftest import hf_greedy
from tests.redis_server import RedisServer
from tests.services.probe import metric, wait_for, workers
from tests.services.up import pdserve_up

NUM_REQUESTS, CONCURRENCY, NUM_PROMPTS = 200, 8, 40
MIN_FAULTS = 5  # the load goes on past NUM_REQUESTS (up to MORE_LOAD_S) until the chaos has struck this often
MORE_LOAD_S = 120.0
RECORD_TTL_S = 5.0
WORKER_ARGS = ["--kv-cache-memory", "6e7", "--heartbeat-ttl-s", "3"]
# A request that cannot complete must say why with one of these (never UNKNOWN/INTERNAL, never a hang).
CLEAR_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
                  grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


class Chaos:
    """Kills a random worker of a random role every 1.5-3 s (keeping one of each role alive) and starts a
    replacement; stops when asked. Replacements are this test's own processes (``stop_all`` ends them)."""

    def __init__(self, rng: random.Random, redis_url: str, model_dir: str, log_dir: Path) -> None:
        self.rng, self.redis_url, self.model_dir, self.log_dir = rng, redis_url, model_dir, log_dir
        self.events: Counter[str] = Counter()
        self.spawned: list[subprocess.Popen] = []
        self.killed: set[int] = set()  # pids signalled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def start(self) -> Chaos:
        self._thread.start()
        return self

    @property
    def faults(self) -> int:
        """Workers killed so far (SIGKILL or SIGTERM)."""
        return sum(n for event, n in list(self.events.items()) if "started" not in event)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        while not self._stop.wait(self.rng.uniform(1.5, 3.0)):
            role = self.rng.choice(["prefill", "decode"])
            live = sorted((w for w in workers(self.redis_url).values()  # its entry outlives a killed one a while
                           if w.role == role and w.state == "ready" and w.pid not in self.killed), key=lambda w: w.id)
            if len(live) < 2:
                continue
            victim = self.rng.choice(live)
            sig = self.rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGTERM])
            os.kill(victim.pid, sig)
            self.killed.add(victim.pid)
            self.events[f"{role} {sig.name}"] += 1
            self._spawn(role)

    def _spawn(self, role: str) -> None:
        name = f"{role}-r{len(self.spawned)}"
        argv = [sys.executable, "-m", "pdserve", role, "--model", self.model_dir, "--port", "0", "--redis-url",
                self.redis_url, "--worker-id", name, *WORKER_ARGS]  # fmt: skip
        with open(self.log_dir / f"{name}.log", "w") as log:
            self.spawned.append(subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        self.events[f"{role} started"] += 1

    def stop_all(self) -> list[int]:
        """SIGTERM every replacement, wait for them all; the exit codes of those the chaos left alone."""
        for proc in self.spawned:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        codes = {proc.pid: proc.wait(60) for proc in self.spawned}
        return [code for pid, code in codes.items() if pid not in self.killed]


def processes_with(needle: str) -> list[str]:
    """Command lines of this machine's processes that contain ``needle``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmdline:
                found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def test_chaos(model_dir, hf_reference, tmp_path, request):
    seed = int(os.environ.get("PDSERVE_CHAOS_SEED", "20261130"))
    rng = random.Random(seed)
    prompts = [[rng.randrange(20, 3000) for _ in range(rng.randrange(8, 300))] for _ in range(NUM_PROMPTS)]
    max_tokens = [rng.randrange(16, 200) for _ in range(NUM_PROMPTS)]
    plan = [rng.randrange(NUM_PROMPTS) for _ in range(NUM_REQUESTS)]
    with RedisServer() as redis_server:
        with pdserve_up("--model", model_dir, "--prefill", "2", "--decode", "2", "--redis-url", redis_server.url,
                        "--log-dir", str(tmp_path), *(f"--worker-arg={a}" for a in WORKER_ARGS),
                        "--router-arg=--kv-lease-s=10", f"--router-arg=--record-ttl-s={RECORD_TTL_S:g}") as up:
            chaos = Chaos(rng, redis_server.url, model_dir, tmp_path)
            request.addfinalizer(chaos.stop_all)  # a failed assertion must not leave the replacements running

            def one(k: int):
                try:
                    with Client(up["router"], timeout_s=120) as client:
                        j = plan[k % NUM_REQUESTS]
                        return client.generate(prompts[j], max_tokens=max_tokens[j], temperature=0.0,
                                               ignore_eos=True)  # fmt: skip
                except grpc.RpcError as exc:
                    return exc

            t0 = time.monotonic()
            chaos.start()
            try:
                # the engine got faster than the chaos: a run can finish its requests before enough faults
                slots, submitted = threading.Semaphore(CONCURRENCY), []
                give_up = time.monotonic() + MORE_LOAD_S
                with ThreadPoolExecutor(CONCURRENCY) as pool:
                    while len(submitted) < NUM_REQUESTS or (chaos.faults < MIN_FAULTS and time.monotonic() < give_up):
                        slots.acquire()
                        submitted.append(pool.submit(one, len(submitted)))
                        submitted[-1].add_done_callback(lambda _f: slots.release())
                outcomes = [f.result() for f in submitted]
            finally:
                chaos.stop()
            took_s = time.monotonic() - t0
            client = connect(redis_server.url)  # the latest records are still there, every one finished
            records = client.keys("pdserve:request:*")
            ttls = {k: client.pttl(k) for k in records}  # -2: it expired since KEYS listed it (not an error)
            outliving = {k: (t, client.hgetall(k)) for k, t in ttls.items() if t == -1 or t > RECORD_TTL_S * 1000}
            assert records and not outliving, outliving
            # figures
            failed = Counter(o.code().name for o in outcomes if isinstance(o, grpc.RpcError))
            done = [(k, o) for k, o in enumerate(outcomes) if not isinstance(o, grpc.RpcError)]
            migrated = sum(1 for _, o in done if o.migrations)
            print(f"\nchaos (seed {seed}): {len(outcomes)} requests at concurrency {CONCURRENCY} in {took_s:.1f} s: "
                  f"{len(done)} completed ({migrated} migrated, {sum(o.migrations for _, o in done)} migrations), "
                  f"failed by status {dict(failed)}; faults {dict(chaos.events)}")
            # every request: the right output, or a clear failure
            hf = hf_reference(model_dir)
            expected = {j: hf_greedy(hf, prompts[j], max_tokens[j]) for j in set(plan)}
            wrong = [k for k, o in done if o.token_ids != expected[plan[k % NUM_REQUESTS]]]
            assert not wrong, f"{len(wrong)} outputs differ from stock generate, e.g. request {wrong[0]}"
            unclear = [o for o in outcomes if isinstance(o, grpc.RpcError)
                       and (o.code() not in CLEAR_FAILURES or not o.details())]  # fmt: skip
            assert not unclear, [(o.code(), o.details()) for o in unclear[:3]]
            assert len(done) >= 0.8 * len(outcomes), "chaos cost more than a fifth of the requests"
            assert chaos.faults >= MIN_FAULTS, chaos.events
            assert metric(up["http"], "pdserve:request_migrations_total") == sum(o.migrations for _, o in done)
            # nothing leaks: KV blocks, request records
            wait_for(lambda: all(w.kv_blocks_used == 0 for w in workers(redis_server.url).values()), 30,
                     "no KV block in use on any worker")
            wait_for(lambda: not client.keys("pdserve:request:*"), RECORD_TTL_S + 5, "request records expired")
            exit_codes = chaos.stop_all()
        assert up["returncode"] == 0
        assert all(code == 0 for code in exit_codes), exit_codes
        assert processes_with(redis_server.url) == []  # no orphan worker or router
