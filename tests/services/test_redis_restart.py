"""Redis restarted (empty) while the cluster is under load: the router keeps routing from its last view of
the registry, every request still completes with the right output, the services report the outage
(``pdserve:redis_up`` 0, ``"redis": "degraded"`` in /healthz) without turning unready, and the workers
re-register when Redis returns. Nothing crashes. Real processes (``pdserve up``) on a Redis of the test's own."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from pdserve.client import Client
from tests.conftest import hf_greedy
from tests.redis_server import RedisServer
from tests.services.probe import metric, wait_for, workers
from tests.services.up import pdserve_up

OUTAGE_S = 5.0  # longer than the heartbeat TTL below: the restarted Redis holds nothing of the old entries


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def cluster(model_dir, redis_server, tmp_path_factory):
    with pdserve_up("--model", model_dir, "--redis-url", redis_server.url, "--log-dir",
                    str(tmp_path_factory.mktemp("redis-restart-logs")), "--worker-arg=--kv-cache-memory=6e7",
                    "--worker-arg=--heartbeat-ttl-s=3") as info:
        info["workers"] = workers(redis_server.url)
        yield info


def health(address: str, path: str = "/healthz") -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


class Load:
    """Two client threads generating greedily in a loop until stopped; each result kept with its time."""

    def __init__(self, router: str, prompts: list[list[int]]) -> None:
        self.router, self.prompts = router, prompts
        self.done: list[tuple[float, list[int], object]] = []  # (finished at, prompt, result or exception)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(2)]

    def _run(self, k: int) -> None:
        with Client(self.router, timeout_s=60) as client:
            i = k
            while not self._stop.is_set():
                prompt = self.prompts[i % len(self.prompts)]
                try:
                    out = client.generate(prompt, max_tokens=10, temperature=0.0, ignore_eos=True)
                except Exception as exc:  # noqa: BLE001 - asserted on by the test
                    out = exc
                self.done.append((time.monotonic(), prompt, out))
                i += 2

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)


def test_redis_restart_under_load(cluster, redis_server, model_dir, hf_reference):
    services = {"router": cluster["http"], **{w.id: w.metrics_address for w in cluster["workers"].values()}}
    prompts = [[(3 * i + 7 * j) % 3000 + 15 for i in range(20 + 6 * j)] for j in range(4)]
    with Load(cluster["router"], prompts) as load:
        wait_for(lambda: len(load.done) >= 4, 60, "the load is running")
        redis_server.stop()
        down_at = time.monotonic()
        for name, address in services.items():  # every service reports the outage, none turns unready
            wait_for(lambda a=address: metric(a, "pdserve:redis_up") == 0, 10, f"{name} reports Redis down")
            code, body = health(address)
            assert (code, body["redis"]) == (200, "degraded"), (name, body)
            assert health(address, "/readyz")[0] == 200, (name, health(address, "/readyz"))
        wait_for(lambda: sum(1 for t, _, _ in load.done if t > down_at + 1) >= 4, 30, "requests served meanwhile")
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
        redis_server.start()  # same port, empty
        up_at = time.monotonic()
        wait_for(lambda: set(workers(redis_server.url)) == set(cluster["workers"]), 10, "every worker re-registered")
        for name, address in services.items():
            wait_for(lambda a=address: metric(a, "pdserve:redis_up") == 1, 10, f"{name} reports Redis up")
            assert health(address)[1]["redis"] == "ok"
        wait_for(lambda: sum(1 for t, _, _ in load.done if t > up_at + 1) >= 4, 30, "requests served after")
    assert cluster["proc"].poll() is None
    assert not [line for line in cluster["stderr"] if "exited with code" in line], cluster["stderr"][-5:]
    hf = hf_reference(model_dir)
    expected = {tuple(p): hf_greedy(hf, p, 10) for p in prompts}
    failed = [out for _, _, out in load.done if isinstance(out, Exception)]
    assert not failed, failed[:3]
    assert all(out.token_ids == expected[tuple(p)] for _, p, out in load.done)
    during = sum(1 for t, _, _ in load.done if down_at < t < up_at)
    print(f"redis restart: {len(load.done)} requests, {during} during the {up_at - down_at:.1f} s outage, 0 failed")
