"""A decode worker streams as many requests at once as its engine runs, not as many as it has gRPC threads: its
Decode streams are served from one asyncio event loop (``build_server(use_asyncio=True)``), so a worker with a
32-thread pool decodes 44 requests in one batch, and each gets the tokens stock ``generate`` gives."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

from pdserve.client import Client
from tests.conftest import hf_greedy
from tests.services.inprocess import inprocess_cluster

STREAMS = 44  # more than the worker's 32 gRPC threads (common.rpc.server.build_server's max_workers)
NEW_TOKENS = 160


def running(metrics_address: str) -> int:
    with urllib.request.urlopen(f"http://{metrics_address}/healthz", timeout=10) as reply:
        return json.loads(reply.read())["num_requests_running"]


def test_a_decode_worker_streams_more_requests_at_once_than_it_has_threads(tiny_model_dir, hf_reference):
    model = tiny_model_dir("llama")
    prompts = [[(7 * i + 11 * j) % 3000 + 4 for j in range(12)] for i in range(STREAMS)]
    with inprocess_cluster(model, prefill=[{"worker_id": "prefill-0"}],
                           decode=[{"worker_id": "decode-0", "max_num_seqs": 64, "prefix_caching": False}]) as c:
        outputs: list[list[int]] = [[] for _ in prompts]
        errors: list[BaseException] = []
        start = threading.Barrier(STREAMS + 1)
        peak, done = [0], threading.Event()

        def one(i: int) -> None:
            try:
                with Client(c.router, timeout_s=120) as client:
                    start.wait()
                    for piece in client.stream(prompts[i], max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True):
                        outputs[i] += piece.token_ids
            except BaseException as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], running(c.metrics["decode-0"]))
                time.sleep(0.01)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
        watcher = threading.Thread(target=watch)
        for t in threads:
            t.start()
        watcher.start()
        start.wait()
        for t in threads:
            t.join(180)
        done.set()
        watcher.join()
    assert not errors, errors[:3]
    assert peak[0] > 32, f"at most {peak[0]} requests decoded at once"  # the thread-bound worker stopped at 32
    reference = hf_reference(model)
    for i in (0, STREAMS // 2, STREAMS - 1):
        assert outputs[i] == hf_greedy(reference, prompts[i], NEW_TOKENS)
    assert all(len(o) == NEW_TOKENS for o in outputs)
