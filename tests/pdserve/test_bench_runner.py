"""``pdserve bench``'s runner against scripted backends, and its command line (flags, usage errors, imports)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pdserve.bench.backend import Chunk
from pdserve.bench.runner import issue, run_pass
from pdserve.bench.workload import Session, Turn, WorkloadSpec, build_sessions
from pdserve.commands import bench as bench_cmd

REPO = Path(__file__).resolve().parents[2]


class Refused(Exception):
    pass


class ScriptedBackend:
    """Streams ``max_tokens`` one-token chunks ``delay_s`` apart (output id = 1000 + prompt length), then the
    usage; every ``fail_every``-th call raises. Records prompts and the most requests ever in flight at once."""

    name = "scripted"

    def __init__(self, delay_s: float = 0.0, fail_every: int = 0, with_ids: bool = True) -> None:
        self.delay_s, self.fail_every, self.with_ids = delay_s, fail_every, with_ids
        self.prompts: list[list[int]] = []
        self.num_in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()

    def stream(self, prompt_ids, *, max_tokens, temperature, timeout_s):
        with self._lock:
            self.prompts.append(list(prompt_ids))
            num_calls = len(self.prompts)
            self.num_in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
        try:
            if self.fail_every and num_calls % self.fail_every == 0:
                raise Refused("scripted failure")
            for _ in range(max_tokens):
                time.sleep(self.delay_s)
                yield Chunk(num_tokens=1, token_ids=[1000 + len(prompt_ids)] if self.with_ids else None)
            yield Chunk(num_tokens=0, completion_tokens=max_tokens)
        finally:
            with self._lock:
                self.num_in_flight -= 1

    def status_of(self, exc):
        return "UNAVAILABLE" if isinstance(exc, Refused) else type(exc).__name__

    def close(self):
        pass


def test_issue_times_one_request():
    record, output_ids = issue(ScriptedBackend(delay_s=0.01), [5, 6, 7], max_tokens=3, temperature=0.0,
                               timeout_s=None, session_index=4, turn_index=1)
    assert output_ids == [1003, 1003, 1003]
    assert (record.session_index, record.turn_index, record.input_tokens, record.max_tokens) == (4, 1, 3, 3)
    assert record.output_tokens == 3 and record.error is None and [k for _, k in record.arrivals] == [1, 1, 1]
    times = [record.send_s] + [t for t, _ in record.arrivals] + [record.end_s]
    assert times == sorted(times) and record.arrivals[0][0] - record.send_s >= 0.01


def test_concurrency_bounds_requests_in_flight():
    backend = ScriptedBackend(delay_s=0.005)
    sessions = build_sessions(WorkloadSpec(num_requests=12, input_len=4, output_len=4), seed=0)
    result = run_pass(backend, sessions, vocab_size=256, concurrency=3, progress=False)
    assert backend.max_in_flight == 3
    assert len(result.records) == 12 and all(r.completed and r.output_tokens == 4 for r in result.records)
    assert sorted(r.session_index for r in result.records) == list(range(12))
    assert result.concurrency == 3 and result.request_rate is None
    assert result.duration_s >= 4 * 4 * 0.005  # 12 requests of 4 tokens, 3 at a time


def test_request_rate_starts_sessions_on_schedule():
    sessions = build_sessions(WorkloadSpec(num_requests=4, input_len=4, output_len=1), seed=0)
    offsets_s = [0.0, 0.1, 0.2, 0.3]
    result = run_pass(ScriptedBackend(), sessions, vocab_size=256, start_offsets_s=offsets_s, request_rate=10.0,
                      progress=False)
    sent_s = {r.session_index: r.send_s - result.start_s for r in result.records}
    for index, offset_s in enumerate(offsets_s):
        assert offset_s <= sent_s[index] < offset_s + 0.08  # never early; late by scheduling noise only
    assert result.request_rate == 10.0 and result.concurrency is None


def test_failures_are_counted_not_raised():
    sessions = build_sessions(WorkloadSpec(num_requests=9, input_len=4, output_len=2), seed=0)
    result = run_pass(ScriptedBackend(fail_every=3), sessions, vocab_size=256, concurrency=2, progress=False)
    assert sorted(r.error or "" for r in result.records) == [""] * 6 + ["UNAVAILABLE"] * 3
    assert all(r.output_tokens == 0 for r in result.records if r.error)


def test_turns_are_sequential_and_prompts_grow_by_the_output():
    sessions = [Session(index=0, turns=[Turn([11, 12], 2), Turn([13], 3), Turn([14, 15, 16], 1)])]
    backend = ScriptedBackend(delay_s=0.002)
    result = run_pass(backend, sessions, vocab_size=256, concurrency=4, progress=False)
    assert backend.prompts == [
        [11, 12],
        [11, 12, 1002, 1002, 13],
        [11, 12, 1002, 1002, 13, 1005, 1005, 1005, 14, 15, 16],
    ]
    records = sorted(result.records, key=lambda r: r.turn_index)
    assert [r.input_tokens for r in records] == [2, 5, 11]
    assert records[0].end_s <= records[1].send_s and records[1].end_s <= records[2].send_s
    assert backend.max_in_flight == 1


def test_outputs_without_ids_are_stood_in_for_by_as_many_tokens():
    sessions = [Session(index=0, turns=[Turn([11, 12], 2), Turn([13], 3)])]
    backend = ScriptedBackend(with_ids=False)
    run_pass(backend, sessions, vocab_size=256, concurrency=1, progress=False)
    second = backend.prompts[1]
    assert len(second) == 5 and second[:2] == [11, 12] and second[-1] == 13
    assert all(10 <= t < 256 for t in second[2:4])


def test_run_pass_needs_one_kind_of_load():
    sessions = [Session(index=0, turns=[Turn([11], 1)])]
    with pytest.raises(ValueError, match="exactly one of"):
        run_pass(ScriptedBackend(), sessions, vocab_size=256, progress=False)
    with pytest.raises(ValueError, match="1 sessions"):
        run_pass(ScriptedBackend(), sessions, vocab_size=256, start_offsets_s=[0.0, 1.0], progress=False)


# -- the command line -----------------------------------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve")
    bench_cmd.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


REQUIRED = ("--num-requests", "20", "--input-len", "16", "--output-len", "8")


def test_flags_and_defaults():
    args = parse(*REQUIRED, "--request-rate", "1,2.5, inf")
    assert args.request_rate == [1.0, 2.5, float("inf")] and args.concurrency is None
    assert (args.arrival, args.turns, args.vocab_size, args.temperature, args.seed) == ("poisson", 1, 256, 0.0, 0)
    assert (args.input_len_range, args.output_len_range, args.shared_prefix_ratio) == (0.0, 0.0, 0.0)
    assert (args.slo_ttft_ms, args.slo_tpot_ms, args.result_json, args.plot_dir) == (None, None, None, None)
    assert not args.http and not args.no_progress and args.func is bench_cmd.bench
    args = parse(*REQUIRED, "--concurrency", "4", "--http", "--router", "h:80", "--arrival", "fixed",
                 "--turns", "3", "--shared-prefix-ratio", "0.5", "--input-len-range", "0.2", "--slo-ttft-ms", "200")
    assert (args.concurrency, args.http, args.router, args.arrival, args.turns) == (4, True, "h:80", "fixed", 3)
    assert (args.shared_prefix_ratio, args.input_len_range, args.slo_ttft_ms) == (0.5, 0.2, 200.0)


@pytest.mark.parametrize("argv, message", [
    ((*REQUIRED,), "one of the arguments --concurrency --request-rate is required"),
    ((*REQUIRED, "--concurrency", "2", "--request-rate", "1"), "not allowed with argument"),
    ((*REQUIRED, "--concurrency", "0"), "--concurrency: must be >= 1, got 0"),
    ((*REQUIRED, "--request-rate", "1,0"), "--request-rate: must be > 0, got 0"),
    ((*REQUIRED, "--request-rate", "1,x"), "--request-rate: not a number: 'x'"),
    ((*REQUIRED, "--concurrency", "2", "--input-len-range", "1"), "--input-len-range: must be in [0, 1), got 1"),
    ((*REQUIRED, "--concurrency", "2", "--shared-prefix-ratio", "1.5"), "must be in [0, 1], got 1.5"),
    ((*REQUIRED, "--concurrency", "2", "--arrival", "bursty"), "invalid choice: 'bursty'"),
    (("--concurrency", "2", "--input-len", "4", "--output-len", "4"), "the following arguments are required"),
])  # fmt: skip
def test_usage_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(*argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_plots_without_matplotlib_fail_before_any_request(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    args = parse(*REQUIRED, "--concurrency", "2", "--router", "127.0.0.1:1", "--plot-dir", str(tmp_path / "p"))
    assert bench_cmd.bench(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "pdserve bench: error: --plot-dir: plots need matplotlib: pip install 'pdserve[bench]'\n"
    assert not (tmp_path / "p").exists()


def test_unreachable_router_is_reported_by_status(capsys):
    args = parse("--num-requests", "3", "--input-len", "4", "--output-len", "2", "--concurrency", "3",
                 "--router", "127.0.0.1:1", "--timeout", "5", "--no-progress")
    assert bench_cmd.bench(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-3:] == ["0", "/", "3"]
    assert lines[2].split() == ["Errors", "UNAVAILABLE", "x3"]


def test_missing_result_directory_fails_before_any_request(tmp_path):
    args = parse(*REQUIRED, "--concurrency", "2", "--router", "127.0.0.1:1", "--result-json",
                 str(tmp_path / "missing" / "r.json"))
    with pytest.raises(ValueError) as err:  # pdserve's main turns it into one line and exit 2
        bench_cmd.bench(args)
    assert str(err.value) == f"--result-json: directory {str(tmp_path / 'missing')!r} does not exist"


def test_the_command_module_imports_nothing_heavy():
    code = (
        "import argparse, sys\n"
        "from pdserve.commands import bench\n"
        "bench.add_parser(argparse.ArgumentParser().add_subparsers())\n"
        "heavy = sorted(m for m in ('torch', 'grpc', 'tqdm', 'matplotlib', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, timeout=30)
