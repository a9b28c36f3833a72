"""Observability on a live cluster (threads, real gRPC, real Redis): metrics agree with what clients saw,
traces cross router → prefill → decode with one trace id, request records carry every stage, health
endpoints say why a service is (not) ready, and log lines carry the request id."""

from __future__ import annotations

import io
import json
import logging
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.obs.logs import JsonFormatter
from pdserve.client import Client
from tests.cli import pdserve
from tests.otlp_collector import otlp_collector
from tests.services.inprocess import inprocess_cluster


@pytest.fixture(scope="module")
def collector():
    with otlp_collector() as sink_and_endpoint:
        yield sink_and_endpoint


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, collector):
    _, endpoint = collector
    with inprocess_cluster(tiny_model_dir("llama"), prefill=[{"worker_id": "prefill-0", "otlp_endpoint": endpoint}],
                           decode=[{"worker_id": "decode-0", "otlp_endpoint": endpoint}],
                           router={"otlp_endpoint": endpoint}) as c:
        yield c


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics endpoint."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_metrics_agree_with_what_the_client_received(cluster):
    router0, prefill0, decode0 = (scrape(a) for a in (cluster.router_http, cluster.metrics["prefill-0"],
                                                      cluster.metrics["decode-0"]))
    with Client(cluster.router) as client:
        results = [client.generate([5, 6, 7, 8 + i], max_tokens=6, temperature=0.0, ignore_eos=True) for i in range(3)]
        with pytest.raises(grpc.RpcError):
            client.generate([], max_tokens=2)
    router, prefill, decode = (scrape(a) for a in (cluster.router_http, cluster.metrics["prefill-0"],
                                                   cluster.metrics["decode-0"]))

    def delta(after, before, name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    tokens = sum(len(r.token_ids) for r in results)
    assert tokens == 18
    assert delta(router, router0, "pdserve:requests_total") == 4  # three served, one invalid
    assert delta(router, router0, "pdserve:generation_tokens_total") == tokens
    assert delta(router, router0, "pdserve:prompt_tokens_total") == 12
    assert delta(router, router0, "pdserve:request_success_total", finished_reason="length") == 3
    assert delta(router, router0, "pdserve:request_failures_total", code="INVALID_ARGUMENT") == 1
    assert delta(router, router0, "pdserve:time_to_first_token_seconds_count") == 3
    assert delta(router, router0, "pdserve:inter_token_latency_seconds_count") == tokens - 3
    assert delta(router, router0, "pdserve:e2e_request_latency_seconds_count") == 3
    assert delta(router, router0, "pdserve:request_repetition_ratio_count") == 3
    assert router[("pdserve:num_requests_running", ())] == 0
    assert router[("pdserve:workers", (("role", "decode"), ("state", "ready")))] == 1
    assert router[("pdserve:redis_up", ())] == 1
    # engine side: prefill computed the prompts and sampled each first token; decode sampled the rest
    assert delta(prefill, prefill0, "pdserve:prompt_tokens_total") == 12
    assert delta(prefill, prefill0, "pdserve:generation_tokens_total") == 3
    assert delta(decode, decode0, "pdserve:generation_tokens_total") == tokens - 3
    assert delta(prefill, prefill0, "pdserve:request_prefill_time_seconds_count") == 3
    assert delta(decode, decode0, "pdserve:request_decode_time_seconds_count") == 3
    assert delta(prefill, prefill0, "pdserve:kv_transfer_seconds_count", transport="grpc") == 3
    sent = delta(prefill, prefill0, "pdserve:kv_transfer_bytes_total", direction="sent")
    received = delta(decode, decode0, "pdserve:kv_transfer_bytes_total", direction="received")
    assert sent == received > 0
    assert decode[("pdserve:kv_cache_blocks_used", ())] == 0


def test_status_lists_each_workers_metrics_address(cluster):
    workers = json.loads(pdserve("status", "--json", "--redis-url", cluster.redis_url).stdout)["workers"]
    assert {w["id"]: w["metrics_address"] for w in workers} == cluster.metrics


def test_health_endpoints_report_readiness_and_role_figures(cluster):
    assert get_json(f"http://{cluster.router_http}/readyz") == (
        200, {"status": "ready", "redis": "ok", "prefill_workers": 1, "decode_workers": 1})
    code, body = get_json(f"http://{cluster.metrics['decode-0']}/readyz")
    assert code == 200 and body["status"] == "ready" and body["kv_blocks_total"] > 0 and "kv_cache_usage" in body
    code, body = get_json(f"http://{cluster.metrics['prefill-0']}/healthz")
    assert code == 200 and body["status"] == "alive" and body["queue"] == 0
    assert "gpu" not in body  # a CPU worker: no NVML figures (common.metrics.gpu)
    assert get_json(f"http://{cluster.router_http}/nope")[0] == 404


def test_one_trace_and_one_record_cover_every_stage(cluster, collector):
    sink, _ = collector
    with Client(cluster.router) as client:
        result = client.generate([9, 10, 11], max_tokens=4, temperature=0.0, ignore_eos=True)
    trace = json.loads(pdserve("trace", result.request_id, "--json", "--redis-url", cluster.redis_url).stdout)
    stages = [s["stage"] for s in trace["stages"]]
    assert stages == ["received", "routed", "queued", "prefill_start", "kv_transfer_start", "prefill_end",
                      "kv_transfer_end", "first_token", "decode_start", "last_token", "finished"]
    at = {s["stage"]: s["at"] for s in trace["stages"]}
    assert at["received"] <= at["routed"] <= at["queued"] <= at["prefill_start"] <= at["prefill_end"]
    assert at["kv_transfer_start"] <= at["kv_transfer_end"] <= at["first_token"] <= at["last_token"]
    assert trace["status"] == "finished" and len(trace["trace_id"]) == 32
    deadline = time.monotonic() + 20  # spans leave in batches (~5 s)
    while time.monotonic() < deadline:
        mine = [s for s in list(sink.spans) if s["trace_id"] == trace["trace_id"]]
        if {s["service"] for s in mine} >= {"pdserve-router", "pdserve-prefill", "pdserve-decode"}:
            break
        time.sleep(0.2)
    names = {(s["service"], s["name"]) for s in mine}
    assert names >= {("pdserve-router", "router.Generate"), ("pdserve-prefill", "prefill.Prefill"),
                     ("pdserve-decode", "decode.ReserveKv"), ("pdserve-decode", "decode.Decode")}
    table = pdserve("trace", result.request_id, "--redis-url", cluster.redis_url).stdout
    assert f"request {result.request_id}: finished (length)" in table and "kv_transfer_end" in table


def test_log_lines_carry_the_request_id(cluster):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("test"))
    logger = logging.getLogger("services.router")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with Client(cluster.router) as client:
            client.generate([5, 6, 7], max_tokens=2, request_id="logged-request-1")
        deadline = time.monotonic() + 10  # the router logs the end after the client got its last message
        while "finished" not in stream.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    finished = [line for line in lines if "finished" in line["msg"]]
    assert len(finished) == 1 and finished[0]["request_id"] == "logged-request-1"
    assert len(finished[0]["trace_id"]) == 32 and finished[0]["service"] == "test"


def test_prefix_cache_hits_through_the_cluster_keep_outputs_equal(cluster, tiny_model_dir, hf_reference):
    from tests.conftest import hf_greedy

    before = scrape(cluster.metrics["prefill-0"])
    system = [(37 * i) % 3000 + 10 for i in range(64)]  # 4 full blocks shared by every prompt
    prompts = [system + [11 + i, 12 + i, 13 + i] for i in range(3)]
    with Client(cluster.router) as client:
        outs = [client.generate(p, max_tokens=5, temperature=0.0, ignore_eos=True).token_ids for p in prompts]
    after = scrape(cluster.metrics["prefill-0"])
    hits = after[("pdserve:prefix_cache_hits_total", ())] - before.get(("pdserve:prefix_cache_hits_total", ()), 0)
    assert hits == 2 * 64  # the 2nd and 3rd prompt reuse the cached system prompt
    hf = hf_reference(tiny_model_dir("llama"))
    assert outs == [hf_greedy(hf, p, 5) for p in prompts]
