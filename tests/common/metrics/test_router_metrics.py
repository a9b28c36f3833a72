from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.metrics import names
from common.metrics.repetition import repeated_ngram_share
from common.metrics.router import RouterMetrics
from common.state.registry import WorkerInfo


def worker(wid: str, role: str, state: str = "ready", used: int = 0, total: int = 100, waiting: int = 0) -> WorkerInfo:
    return WorkerInfo(id=wid, role=role, address="127.0.0.1:1", host="h", pid=1, model="m", version="v",
                      num_requests_running=1, num_requests_waiting=waiting, kv_blocks_used=used, kv_blocks_total=total,
                      state=state)


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture
def clock(monkeypatch):
    """Drive time.monotonic in common.metrics.router by hand."""
    now = [100.0]
    monkeypatch.setattr("common.metrics.router.time.monotonic", lambda: now[0])
    return now


def test_a_request_observes_ttft_itl_tpot_e2e_and_its_finish(clock):
    m = RouterMetrics(lambda: [], lambda: True)
    timer = m.start_request(num_prompt_tokens=7)
    assert samples(m)[("pdserve:num_requests_running", ())] == 1
    clock[0] = 100.5
    timer.on_tokens([1])  # TTFT 0.5 s
    clock[0] = 100.9
    timer.on_tokens([2, 3])  # one message of two tokens after 0.4 s: two gaps of 0.2 s
    timer.on_tokens([])  # text-only message: nothing
    clock[0] = 101.0
    timer.finish("length")
    timer.fail("CANCELLED")  # ignored: the request already ended
    s = samples(m)
    assert s[("pdserve:time_to_first_token_seconds_sum", ())] == pytest.approx(0.5)
    assert s[("pdserve:inter_token_latency_seconds_count", ())] == 2
    assert s[("pdserve:inter_token_latency_seconds_sum", ())] == pytest.approx(0.4)
    assert s[("pdserve:inter_token_latency_seconds_bucket", (("le", "0.3"),))] == 2
    assert s[("pdserve:request_time_per_output_token_seconds_sum", ())] == pytest.approx(0.2)  # 0.4 s / 2 gaps
    assert s[("pdserve:e2e_request_latency_seconds_sum", ())] == pytest.approx(1.0)
    assert s[("pdserve:requests_total", ())] == 1 and s[("pdserve:prompt_tokens_total", ())] == 7
    assert s[("pdserve:generation_tokens_total", ())] == 3
    assert s[("pdserve:request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("pdserve:request_failures_total", (("code", "CANCELLED"),))] == 0
    assert s[("pdserve:num_requests_running", ())] == 0
    assert s[("pdserve:request_repetition_ratio_count", ())] == 0  # 3 tokens: too short to judge


def test_a_failed_request_counts_its_code_once(clock):
    m = RouterMetrics(lambda: [], lambda: True)
    timer = m.start_request(3)
    timer.fail("UNAVAILABLE")
    timer.finish("stop")
    s = samples(m)
    assert s[("pdserve:request_failures_total", (("code", "UNAVAILABLE"),))] == 1
    assert s[("pdserve:request_success_total", (("finished_reason", "stop"),))] == 0
    assert s[("pdserve:e2e_request_latency_seconds_count", ())] == 0 and s[("pdserve:num_requests_running", ())] == 0


def test_pool_figures_come_from_the_registry_view():
    workers = [worker("p0", "prefill", waiting=3), worker("p1", "prefill", state="draining", waiting=1),
               worker("d0", "decode", used=30), worker("d1", "decode", used=10, total=300)]
    up = [True]
    m = RouterMetrics(lambda: workers, lambda: up[0])
    s = samples(m)
    assert s[("pdserve:workers", (("role", "prefill"), ("state", "ready")))] == 1
    assert s[("pdserve:workers", (("role", "prefill"), ("state", "draining")))] == 1
    assert s[("pdserve:workers", (("role", "decode"), ("state", "draining")))] == 0
    assert s[("pdserve:pool_num_requests_waiting", (("role", "prefill"),))] == 4
    assert s[("pdserve:pool_num_requests_running", (("role", "decode"),))] == 2
    assert s[("pdserve:pool_kv_cache_usage_perc", (("role", "decode"),))] == pytest.approx(0.1)
    assert s[("pdserve:redis_up", ())] == 1
    up[0] = False
    assert samples(m)[("pdserve:redis_up", ())] == 0


def test_the_router_exposes_every_router_metric_name():
    exposed = {name for name, _ in samples(RouterMetrics(lambda: [], lambda: True))}
    for spec in names.ROUTER_METRICS:
        assert set(names.exposed_names(spec)) <= exposed, spec.name


@pytest.mark.parametrize("tokens, share", [
    ([1, 2, 3, 4], None),  # one 4-gram: nothing to compare
    ([1, 2, 3, 4, 5, 6, 7, 8], 0.0),
    ([7] * 10, 6 / 7),  # a loop: every 4-gram after the first repeats it
    ([1, 2, 3, 4, 1, 2, 3, 4], 1 / 5),
])  # fmt: skip
def test_repeated_ngram_share(tokens, share):
    assert repeated_ngram_share(tokens) == (share if share is None else pytest.approx(share))
