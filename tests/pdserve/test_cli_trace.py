"""``pdserve trace`` against a real redis-server holding request records."""

from __future__ import annotations

import json

import pytest

from common.state.records import RequestRecord, RequestStore
from common.state.redis_client import connect
from tests.cli import pdserve
from tests.redis_server import RedisServer, free_port


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def test_a_finished_request_shows_its_stages_in_order(redis_url):
    store = RequestStore(connect(redis_url))
    t0 = 1_800_000_000.0
    store.create(RequestRecord(request_id="r1", status="queued", num_prompt_tokens=5, created_at=t0,
                               trace_id="ab" * 16))
    store.update("r1", status="decoding", prefill_worker_id="prefill-0", decode_worker_id="decode-0",
                 routed_at=t0 + 0.010, queued_at=t0 + 0.011, prefill_started_at=t0 + 0.012,
                 kv_transfer_started_at=t0 + 0.020, prefill_finished_at=t0 + 0.050,
                 kv_transfer_finished_at=t0 + 0.052, first_token_at=t0 + 0.053, decode_started_at=t0 + 0.054,
                 last_token_at=t0 + 0.200, num_tokens_emitted=9)
    store.finish("r1", "finished", finish_reason="length")
    out = json.loads(pdserve("trace", "r1", "--json", "--redis-url", redis_url).stdout)
    assert out["request_id"] == "r1" and out["trace_id"] == "ab" * 16 and out["num_tokens_emitted"] == 9
    stages = [(s["stage"], s["offset_ms"]) for s in out["stages"]]
    assert stages[:-1] == [("received", 0.0), ("routed", 10.0), ("queued", 11.0), ("prefill_start", 12.0),
                           ("kv_transfer_start", 20.0), ("prefill_end", 50.0), ("kv_transfer_end", 52.0),
                           ("first_token", 53.0), ("decode_start", 54.0), ("last_token", 200.0)]
    assert stages[-1][0] == "finished"
    assert [s["delta_ms"] for s in out["stages"][:3]] == [0.0, 10.0, 1.0]
    text = pdserve("trace", "r1", "--redis-url", redis_url).stdout
    assert "request r1: finished (length)" in text and "prefill prefill-0 -> decode decode-0" in text
    assert "kv_transfer_end" in text and "+      52.0 ms" in text


def test_a_request_still_waiting_shows_only_what_happened(redis_url):
    store = RequestStore(connect(redis_url))
    store.create(RequestRecord(request_id="r2", status="queued", created_at=1_800_000_000.0))
    out = json.loads(pdserve("trace", "r2", "--json", "--redis-url", redis_url).stdout)
    assert [s["stage"] for s in out["stages"]] == ["received"]


def test_unknown_request_and_unreachable_redis_fail_with_one_line(redis_url):
    missing = pdserve("trace", "nope", "--redis-url", redis_url, check=False)
    assert missing.returncode == 1 and "no record of request 'nope'" in missing.stderr
    down = pdserve("trace", "r1", "--redis-url", f"redis://127.0.0.1:{free_port()}/0", check=False)
    assert down.returncode == 1 and "cannot read from Redis" in down.stderr
