"""Many streams at once: a decode worker streams as many requests as its batch holds, not as many as it has gRPC
threads (its Decode streams share one asyncio event loop: ``build_server(use_asyncio=True)``; it stopped at its
32 threads before), a prefill worker takes as many as ``--max-pending-requests`` (its pool stopped it at 32),
and the router serves more than its former 64 streams at once (``--max-streams``, 1024; its streams share one
event loop). 72 streams through one router to one prefill and one decode worker, each the tokens stock
``generate`` gives. With ``--max-streams 2`` a third stream waits for one to end, then is served."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import pytest

from pdserve.client import Client
from services.router import main as router_main
from services.router.config import RouterConfig
from tests.conftest import hf_greedy
from tests.services.inprocess import inprocess_cluster

STREAMS = 72  # more than the decode worker's 32 gRPC threads and the router's former 64
NEW_TOKENS = 160


@dataclass
class Load:
    prompts: list[list[int]]
    outputs: list[list[int]] = field(default_factory=list)
    first_token_s: list[float] = field(default_factory=list)  # since the start, per stream
    end_s: list[float] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    peak_running: int = 0  # most requests the decode worker reported running at once
    peak_prefilling: int = 0  # most requests the prefill worker held at once (its KV transfers in flight)


def health(metrics_address: str) -> dict:
    with urllib.request.urlopen(f"http://{metrics_address}/healthz", timeout=10) as reply:
        return json.loads(reply.read())


@pytest.fixture(scope="module")
def load(tiny_model_dir) -> Load:
    prompts = [[(7 * i + 11 * j) % 3000 + 4 for j in range(12)] for i in range(STREAMS)]
    result = Load(prompts, [[] for _ in prompts], [0.0] * STREAMS, [0.0] * STREAMS)
    with inprocess_cluster(tiny_model_dir("llama"), prefill=[{"worker_id": "prefill-0", "max_num_seqs": 96}],
                           decode=[{"worker_id": "decode-0", "max_num_seqs": 96, "prefix_caching": False}]) as c:
        start = threading.Barrier(STREAMS + 1)
        done = threading.Event()
        t0 = [0.0]

        def one(i: int) -> None:
            try:
                with Client(c.router, timeout_s=120) as client:
                    start.wait()
                    for piece in client.stream(prompts[i], max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True):
                        if piece.token_ids and not result.outputs[i]:
                            result.first_token_s[i] = time.monotonic() - t0[0]
                        result.outputs[i] += piece.token_ids
                result.end_s[i] = time.monotonic() - t0[0]
            except BaseException as exc:  # noqa: BLE001 - asserted by the tests
                result.errors.append(exc)

        def watch(worker: str, key: str, peak: str) -> None:
            while not done.is_set():
                setattr(result, peak, max(getattr(result, peak), health(c.metrics[worker])[key]))
                time.sleep(0.002)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
        watchers = [threading.Thread(target=watch, args=("decode-0", "num_requests_running", "peak_running")),
                    threading.Thread(target=watch, args=("prefill-0", "kv_transfers_in_flight", "peak_prefilling"))]
        for t in threads + watchers:
            t.start()
        start.wait()
        t0[0] = time.monotonic()
        for t in threads:
            t.join(180)
        done.set()
        for t in watchers:
            t.join()
    return result


def test_every_stream_gets_the_tokens_of_stock_generate(load, tiny_model_dir, hf_reference):
    assert not load.errors, load.errors[:3]
    assert all(len(o) == NEW_TOKENS for o in load.outputs)
    reference = hf_reference(tiny_model_dir("llama"))
    for i in (0, STREAMS // 2, STREAMS - 1):
        assert load.outputs[i] == hf_greedy(reference, load.prompts[i], NEW_TOKENS)


def test_a_decode_worker_decodes_more_requests_at_once_than_it_has_threads(load):
    assert load.peak_running > 32, f"at most {load.peak_running} requests decoded at once"


def test_a_prefill_worker_takes_more_requests_at_once_than_32(load):
    # its gRPC pool had 32 threads, each Prefill call holding one until its KV was sent: the batch stopped at 32
    assert load.peak_prefilling > 32, f"at most {load.peak_prefilling} requests held by the prefill worker"


def test_the_router_serves_more_streams_at_once_than_64(load):
    # with 64 router threads the last streams got no thread, so no first token, until a stream had ended
    first_end = min(load.end_s)
    late = [i for i, t in enumerate(load.first_token_s) if t >= first_end]
    assert not late, f"{len(late)} streams started only after the first had ended (at {first_end:.2f} s)"


def test_a_router_refuses_max_streams_below_one(tiny_model_dir):
    with pytest.raises(ValueError, match="--max-streams must be at least 1, got 0"):
        router_main.run(RouterConfig(model=tiny_model_dir("llama"), max_streams=0))


def test_a_router_refuses_a_negative_pair_cooldown(tiny_model_dir):
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match=f"--pair-cooldown-s must be >= 0 seconds .*, got {bad}"):
            router_main.run(RouterConfig(model=tiny_model_dir("llama"), pair_cooldown_s=bad))


def test_max_streams_holds_later_streams_until_one_ends(tiny_model_dir):
    prompts = [[(5 * i + 3 * j) % 3000 + 4 for j in range(12)] for i in range(3)]
    first_token_s, end_s, errors = [0.0] * 3, [0.0] * 3, []
    with inprocess_cluster(tiny_model_dir("llama"), prefill=[{"worker_id": "prefill-0"}],
                           decode=[{"worker_id": "decode-0"}], router={"max_streams": 2}) as c:
        start = threading.Barrier(4)

        def one(i: int) -> None:
            try:
                with Client(c.router, timeout_s=60) as client:
                    start.wait()
                    t0 = time.monotonic()
                    for piece in client.stream(prompts[i], max_tokens=48, temperature=0.0, ignore_eos=True):
                        if piece.token_ids and not first_token_s[i]:
                            first_token_s[i] = time.monotonic() - t0
                    end_s[i] = time.monotonic() - t0
            except BaseException as exc:  # noqa: BLE001 - asserted below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        start.wait()
        for t in threads:
            t.join(90)
    assert not errors, errors
    late = [i for i in range(3) if first_token_s[i] >= min(end_s)]
    assert len(late) == 1, f"first tokens {first_token_s}, ends {end_s}: one stream should have waited"
