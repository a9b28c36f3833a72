"""``pdserve bench`` against a live in-process cluster (Redis, router, one prefill and one decode worker).

The bench's token counts must equal the increase of the router's own counters over the run.
"""

from __future__ import annotations

import json
import urllib.request
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cli import build_parser
from tests.cli import pdserve
from tests.services.inprocess import inprocess_cluster

LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with inprocess_cluster(tiny_model_dir("llama"), prefill=[{"worker_id": "prefill-0"}],
                           decode=[{"worker_id": "decode-0"}]) as cluster:  # fmt: skip
        yield cluster


def run_bench(router: str, result_json, *argv: str) -> dict:
    """``pdserve bench`` in this process; returns the JSON result."""
    args = build_parser().parse_args(["bench", "--router", router, "--no-progress", "--result-json",
                                      str(result_json), *argv])  # fmt: skip
    assert args.func(args) == 0
    return json.loads(result_json.read_text())


def scrape(address: str) -> dict[str, float]:
    """Every sample of the router's ``/metrics`` by sample name, summed over labels."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    values: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] += sample.value
    return values


def test_bench_of_20_requests(cluster, tmp_path):
    result = run_bench(cluster.router, tmp_path / "r.json", "--num-requests", "20", "--concurrency", "4",
                       "--input-len", "16", "--output-len", "8")
    assert (result["completed"], result["failed"], result["errors"]) == (20, 0, {})
    assert (result["input_tokens"], result["output_tokens"]) == (320, 160)
    assert result["request_throughput"] > 0 and result["output_throughput"] == pytest.approx(
        160 / result["duration_s"])
    for key in LATENCY_KEYS:
        stats = result[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (key, stats)
    assert result["tpot_ms"]["mean"] == pytest.approx(result["itl_ms"]["mean"], rel=0.01)  # 1 token a message
    assert result["ttft_ms"]["p99"] <= result["e2e_ms"]["p99"]
    assert result["goodput"] == result["request_throughput"]  # no SLO given: every completed request counts
    assert result["settings"]["protocol"] == "grpc" and result["settings"]["router"] == cluster.router


def test_token_counts_equal_the_router_counters(cluster, tmp_path):
    router_http = getattr(cluster, "router_http")
    before = scrape(router_http)
    result = run_bench(cluster.router, tmp_path / "r.json", "--num-requests", "20", "--concurrency", "4",
                       "--input-len", "16", "--output-len", "8", "--seed", "11")
    after = scrape(router_http)
    assert (result["completed"], result["output_tokens"], result["input_tokens"]) == (20, 160, 320)

    def increase(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert increase("pdserve:requests_total") == 20
    assert increase("pdserve:generation_tokens_total") == result["output_tokens"]
    assert increase("pdserve:prompt_tokens_total") == result["input_tokens"]


def test_multi_turn_sessions_at_a_request_rate(cluster, tmp_path):
    result = run_bench(cluster.router, tmp_path / "r.json", "--num-requests", "8", "--turns", "2",
                       "--request-rate", "50", "--arrival", "fixed", "--shared-prefix-ratio", "0.5",
                       "--input-len", "16", "--output-len", "8")
    assert (result["completed"], result["failed"], result["output_tokens"]) == (8, 0, 64)
    # 4 sessions: a first prompt of 16 tokens, then 16 + 8 output + 16 new tokens
    assert result["input_tokens"] == 4 * 16 + 4 * (16 + 8 + 16)
    assert result["request_rate"] == 50.0 and result["concurrency"] is None


def test_errors_are_reported_by_grpc_status_and_exit_0(cluster, tmp_path):
    out = tmp_path / "r.json"
    proc = pdserve("bench", "--router", cluster.router, "--num-requests", "6", "--concurrency", "2",
                   "--input-len", "16", "--output-len", "4", "--vocab-size", "100000", "--no-progress",
                   "--result-json", str(out), timeout_s=60)  # ids past the tiny model's vocabulary
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["errors"]) == (0, 6, {"INVALID_ARGUMENT": 6})
    assert result["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    lines = proc.stdout.splitlines()
    assert lines[0] == "==== pdserve bench: concurrency 2 ===="
    assert lines[2].split() == ["Errors", "INVALID_ARGUMENT", "x6"]


def test_http_bench_against_the_routers_openai_api_counts_like_grpc(cluster, tmp_path):
    before = scrape(cluster.router_http)
    result = run_bench(cluster.router_http, tmp_path / "r.json", "--http", "--num-requests", "12", "--concurrency",
                       "3", "--input-len", "16", "--output-len", "8")  # fmt: skip
    after = scrape(cluster.router_http)
    assert (result["completed"], result["failed"], result["output_tokens"]) == (12, 0, 96)
    assert result["settings"]["protocol"] == "http"
    assert after["pdserve:generation_tokens_total"] - before["pdserve:generation_tokens_total"] == 96
    for key in LATENCY_KEYS:
        assert 0 < result[key]["p50"] <= result[key]["p99"], key


def test_multi_turn_sessions_carry_session_ids_and_reuse_kv(cluster, tmp_path):
    from common.state.records import SessionStore
    from common.state.redis_client import connect

    redis = connect(cluster.redis_url)
    before = set(redis.keys("pdserve:session:bench-*"))
    result = run_bench(cluster.router, tmp_path / "r.json", "--num-requests", "6", "--turns", "3", "--concurrency",
                       "2", "--input-len", "20", "--output-len", "4")  # fmt: skip
    assert (result["completed"], result["failed"]) == (6, 0)
    keys = set(redis.keys("pdserve:session:bench-*")) - before
    assert len(keys) == 2  # one record per session of this run
    for key in keys:  # the whole conversation: 3 turns of 20 user tokens, 2 outputs fed back, the last output
        session = SessionStore(redis).get(key.decode().split(":", 2)[2])
        assert len(session.token_ids) == 3 * 20 + 3 * 4
