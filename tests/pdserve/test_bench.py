"""``pdserve bench``'s pure parts: the workload, the per-request metrics, goodput, and the report's shape."""

from __future__ import annotations

import json

import pytest

from pdserve.bench import metrics, report, workload
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.runner import PassResult
from pdserve.bench.workload import MIN_TOKEN_ID, WorkloadSpec

CONTRACT_KEYS = {"completed", "failed", "output_tokens", "request_throughput", "output_throughput", "ttft_ms",
                 "tpot_ms", "itl_ms", "e2e_ms"}  # fmt: skip


# -- workload ------------------------------------------------------------------------------------------------


def test_length_bounds():
    assert workload.length_bounds(100, 0.5) == (50, 150)
    assert workload.length_bounds(8, 0.0) == (8, 8)
    assert workload.length_bounds(1, 0.9) == (1, 2)  # never below 1


def test_lengths_and_ids_in_range():
    spec = WorkloadSpec(num_requests=300, input_len=40, output_len=20, input_len_range=0.5, output_len_range=0.25,
                        vocab_size=50)
    sessions = workload.build_sessions(spec, seed=3)
    assert len(sessions) == 300 and all(len(s.turns) == 1 for s in sessions)
    input_lens = [len(s.turns[0].user_ids) for s in sessions]
    output_lens = [s.turns[0].max_tokens for s in sessions]
    assert min(input_lens) == 20 and max(input_lens) == 60  # 300 draws over 41 values reach both ends
    assert min(output_lens) == 15 and max(output_lens) == 25
    ids = {t for s in sessions for t in s.turns[0].user_ids}
    assert ids == set(range(MIN_TOKEN_ID, 50))


def test_fixed_lengths_without_a_range():
    sessions = workload.build_sessions(WorkloadSpec(num_requests=5, input_len=16, output_len=8), seed=0)
    assert [(len(s.turns[0].user_ids), s.turns[0].max_tokens) for s in sessions] == [(16, 8)] * 5


def test_shared_prefix_is_shared_by_every_prompt():
    spec = WorkloadSpec(num_requests=50, input_len=40, output_len=4, input_len_range=0.5, shared_prefix_ratio=0.5,
                        vocab_size=4096)
    prompts = [s.turns[0].user_ids for s in workload.build_sessions(spec, seed=1)]
    longest = max(prompts, key=len)
    for prompt in prompts:
        num_shared = round(0.5 * len(prompt))
        assert prompt[:num_shared] == longest[:num_shared]
    # past the shared part, prompts differ: no two share the token right after their prefix and the next one
    tails = {tuple(p[round(0.5 * len(p)):][:2]) for p in prompts}
    assert len(tails) == len(prompts)


def test_without_shared_prefix_prompts_start_differently():
    spec = WorkloadSpec(num_requests=50, input_len=16, output_len=4, vocab_size=4096)
    prompts = [s.turns[0].user_ids for s in workload.build_sessions(spec, seed=1)]
    assert len({tuple(p[:2]) for p in prompts}) == 50


def test_whole_prompt_shared():
    spec = WorkloadSpec(num_requests=4, input_len=12, output_len=4, shared_prefix_ratio=1.0)
    prompts = [s.turns[0].user_ids for s in workload.build_sessions(spec, seed=0)]
    assert all(p == prompts[0] for p in prompts) and len(prompts[0]) == 12


def test_multi_turn_sessions():
    spec = WorkloadSpec(num_requests=7, input_len=10, output_len=3, turns=3, shared_prefix_ratio=0.5)
    sessions = workload.build_sessions(spec, seed=0)
    assert [s.index for s in sessions] == [0, 1, 2]
    assert [len(s.turns) for s in sessions] == [3, 3, 1]  # 7 requests: the last session gets the remainder
    assert all(len(t.user_ids) == 10 and t.max_tokens == 3 for s in sessions for t in s.turns)
    firsts = [s.turns[0].user_ids[:5] for s in sessions]
    assert firsts[0] == firsts[1] == firsts[2]  # the shared prefix starts each session's first prompt
    assert sessions[0].turns[1].user_ids[:5] != firsts[0]  # later turns are new user tokens


def test_next_prompt_grows_by_output_and_user_tokens():
    assert workload.next_prompt([1, 2], [3], [4, 5]) == [1, 2, 3, 4, 5]


def test_seeded_workload_is_reproducible():
    spec = WorkloadSpec(num_requests=20, input_len=16, output_len=8, input_len_range=0.5, output_len_range=0.5,
                        shared_prefix_ratio=0.25, turns=2)
    assert workload.build_sessions(spec, seed=7) == workload.build_sessions(spec, seed=7)
    assert workload.build_sessions(spec, seed=7) != workload.build_sessions(spec, seed=8)


@pytest.mark.parametrize("overrides, message", [
    ({"num_requests": 0}, "num_requests must be >= 1, got 0"),
    ({"input_len_range": 1.0}, "input_len_range must be in [0, 1), got 1.0"),
    ({"shared_prefix_ratio": -0.1}, "shared_prefix_ratio must be in [0, 1], got -0.1"),
    ({"vocab_size": 10}, "vocab_size must be > 10, got 10"),
])  # fmt: skip
def test_spec_names_a_bad_value(overrides, message):
    with pytest.raises(ValueError) as err:
        WorkloadSpec(**({"num_requests": 1, "input_len": 4, "output_len": 4} | overrides))
    assert str(err.value) == message


def test_fixed_arrivals():
    assert workload.arrival_times_s(4, 4.0, "fixed", seed=0) == [0.0, 0.25, 0.5, 0.75]
    assert workload.arrival_times_s(3, float("inf"), "poisson", seed=0) == [0.0, 0.0, 0.0]


def test_poisson_arrivals():
    times_s = workload.arrival_times_s(4001, 20.0, "poisson", seed=5)
    gaps = [b - a for a, b in zip(times_s, times_s[1:])]
    assert times_s[0] == 0.0 and all(g >= 0 for g in gaps)
    assert 0.045 < sum(gaps) / len(gaps) < 0.055  # mean 1/rate
    assert len(set(gaps)) == len(gaps)  # exponential, not fixed
    assert workload.arrival_times_s(50, 20.0, "poisson", seed=5) == times_s[:50]
    assert workload.arrival_times_s(50, 20.0, "poisson", seed=6) != times_s[:50]
    with pytest.raises(ValueError, match="arrival must be one of"):
        workload.arrival_times_s(3, 1.0, "bursty", seed=0)


# -- per-request metrics and goodput --------------------------------------------------------------------------


def make_record(send_s=0.0, arrivals=(), end_s=None, error=None, input_tokens=4, output_tokens=None):
    arrivals = list(arrivals)
    return RequestRecord(session_index=0, turn_index=0, input_tokens=input_tokens, max_tokens=8, send_s=send_s,
                         end_s=end_s if end_s is not None else (arrivals[-1][0] if arrivals else send_s),
                         arrivals=arrivals, error=error,
                         output_tokens=sum(k for _, k in arrivals) if output_tokens is None else output_tokens)


def test_itl_splits_a_message_of_k_tokens_into_k_gaps():
    gaps = metrics.itls_s([(1.0, 1), (1.1, 1), (1.4, 3), (1.5, 1)])
    assert gaps == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1])
    assert metrics.itls_s([(1.0, 2)]) == []  # the first message's extra tokens are not gaps
    assert metrics.itls_s([]) == []


def test_ttft_tpot_e2e():
    record = make_record(send_s=10.0, arrivals=[(10.5, 1), (10.7, 1), (11.1, 2)], end_s=11.2)
    assert metrics.ttft_s(record) == pytest.approx(0.5)
    assert metrics.tpot_s(record) == pytest.approx((11.1 - 10.5) / 3)
    assert metrics.e2e_s(record) == pytest.approx(1.2)
    assert metrics.tpot_s(make_record(arrivals=[(0.2, 1)])) is None  # one token: no TPOT
    assert metrics.ttft_s(make_record(arrivals=[])) is None


def test_percentile_interpolates_linearly():
    assert metrics.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert metrics.percentile([float(v) for v in range(11)], 90) == 9.0
    assert metrics.percentile([float(v) for v in range(101)], 99) == 99.0
    assert metrics.percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert metrics.percentile([7.0], 99) == 7.0
    assert metrics.percentile([], 50) is None
    with pytest.raises(ValueError):
        metrics.percentile([1.0], 101)


def test_goodput_needs_both_slos():
    fast = make_record(arrivals=[(0.05, 1), (0.06, 1), (0.07, 1)])  # TTFT 50 ms, TPOT 10 ms
    slow_start = make_record(arrivals=[(0.30, 1), (0.31, 1), (0.32, 1)])  # TTFT 300 ms, TPOT 10 ms
    slow_tokens = make_record(arrivals=[(0.05, 1), (0.15, 1), (0.25, 1)])  # TTFT 50 ms, TPOT 100 ms
    one_token = make_record(arrivals=[(0.05, 1)])  # no TPOT: meets any TPOT SLO
    failed = make_record(arrivals=[(0.05, 1), (0.06, 1)], error="UNAVAILABLE")
    records = [fast, slow_start, slow_tokens, one_token, failed]
    assert metrics.goodput(records, 2.0, 0.1, 0.05) == 1.0  # fast, one_token
    assert metrics.goodput(records, 2.0, 0.1, None) == 1.5  # + slow_tokens
    assert metrics.goodput(records, 2.0, None, 0.05) == 1.5  # + slow_start
    assert metrics.goodput(records, 2.0, None, None) == 2.0  # every completed request
    assert metrics.goodput(records, 0.0, None, None) == 0.0


# -- report ---------------------------------------------------------------------------------------------------


def sample_pass(request_rate=None, concurrency=2) -> PassResult:
    records = [
        make_record(send_s=0.0, arrivals=[(0.1, 1), (0.2, 1), (0.3, 2)], end_s=0.35, input_tokens=10),
        make_record(send_s=0.5, arrivals=[(0.7, 1), (0.8, 1), (0.9, 1), (1.0, 1)], end_s=1.0, input_tokens=6),
        make_record(send_s=1.0, arrivals=[(1.2, 1)], end_s=1.3, error="UNAVAILABLE"),
        make_record(send_s=1.0, arrivals=[], end_s=1.1, error="DEADLINE_EXCEEDED"),
        make_record(send_s=1.0, arrivals=[], end_s=1.1, error="UNAVAILABLE"),
    ]
    return PassResult(records=records, start_s=0.0, end_s=2.0, request_rate=request_rate, concurrency=concurrency)


def test_summary_of_a_pass():
    summary = report.summarize(sample_pass(), report.Slo(ttft_ms=150.0, tpot_ms=None))
    assert summary["completed"] == 2 and summary["failed"] == 3
    assert summary["errors"] == {"DEADLINE_EXCEEDED": 1, "UNAVAILABLE": 2}
    assert (summary["input_tokens"], summary["output_tokens"]) == (16, 8)
    assert summary["duration_s"] == 2.0
    assert summary["request_throughput"] == 1.0 and summary["output_throughput"] == 4.0
    assert summary["total_token_throughput"] == 12.0
    assert summary["goodput"] == 0.5  # only the first request's TTFT (100 ms) meets 150 ms
    assert (summary["request_rate"], summary["concurrency"]) == (None, 2)
    assert summary["ttft_ms"] == pytest.approx({"mean": 150.0, "p50": 150.0, "p90": 190.0, "p99": 199.0})
    assert summary["e2e_ms"]["p50"] == pytest.approx(425.0)  # 350 and 500 ms
    assert summary["tpot_ms"]["mean"] == pytest.approx((200 / 3 + 300 / 3) / 2)  # 200 ms and 300 ms over 3 gaps
    # ITL: request 1 gaps 100, 50, 50 (the 2-token message); request 2 gaps 100, 100, 100
    assert sorted(report.latency_samples_ms(sample_pass())["itl_ms"]) == pytest.approx([50, 50, 100, 100, 100, 100])


def test_no_samples_give_null_latencies():
    result = PassResult(records=[make_record(error="UNAVAILABLE")], start_s=0.0, end_s=1.0, request_rate=4.0)
    summary = report.summarize(result, report.Slo())
    assert summary["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert summary["completed"] == 0 and summary["goodput"] == 0.0 and summary["request_rate"] == 4.0


def test_result_json_keeps_the_first_run_at_top_level(tmp_path):
    runs = [report.summarize(sample_pass(request_rate=r, concurrency=None), report.Slo()) for r in (1.0, float("inf"))]
    result = report.result_json(runs, {"seed": 0})
    path = tmp_path / "result.json"
    report.write_json(str(path), result)
    loaded = json.loads(path.read_text())
    assert CONTRACT_KEYS <= set(loaded)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(loaded[key]) == {"mean", "p50", "p90", "p99"}
        assert loaded[key]["p50"] <= loaded[key]["p90"] <= loaded[key]["p99"]
    assert loaded["request_rate"] == 1.0 and loaded["settings"] == {"seed": 0}
    assert [run["request_rate"] for run in loaded["runs"]] == [1.0, "inf"]
    assert {k: v for k, v in loaded.items() if k not in ("settings", "runs")} == loaded["runs"][0]
    with pytest.raises(ValueError):
        report.result_json([], {})


def test_tables_for_people():
    summary = report.summarize(sample_pass(), report.Slo(ttft_ms=150.0, tpot_ms=40.0))
    text = report.format_summary(summary, report.Slo(ttft_ms=150.0, tpot_ms=40.0))
    lines = text.splitlines()
    assert lines[0] == "==== pdserve bench: concurrency 2 ===="
    assert lines[2].split(maxsplit=1) == ["Errors", "DEADLINE_EXCEEDED x1, UNAVAILABLE x2"]
    assert any(line.startswith("Goodput (req/s; SLO: TTFT <= 150 ms, TPOT <= 40 ms)") for line in lines)
    assert lines[-4].split() == ["TTFT", "150.00", "150.00", "190.00", "199.00"]
    sweep = report.format_sweep([report.summarize(sample_pass(request_rate=r, concurrency=None), report.Slo())
                                 for r in (2.0, 4.0)])
    assert [line.split()[:3] for line in sweep.splitlines()] == [
        ["LOAD", "REQ/S", "TOK/S"], ["rate", "2/s", "1.00"], ["rate", "4/s", "1.00"]]
