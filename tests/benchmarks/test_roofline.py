"""benchmarks/roofline.py on the tiny model, its machine probes replaced by set figures: each prefill round's
fractions are taken against the higher of the two peak probes around it, and the figures reported are the median
round's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import roofline  # noqa: E402


def test_each_round_is_measured_against_the_peak_probed_around_it(tiny_model_dir, monkeypatch, capsys):
    # the start's probe (fp32), then two a round: rounds' peaks max(100, 300), max(50, 200), max(400, 20)
    probes = iter([250e9, 100e9, 300e9, 50e9, 200e9, 400e9, 20e9])
    monkeypatch.setattr(roofline, "matmul_flops", lambda dtype, n=2048, repeats=5: next(probes))
    monkeypatch.setattr(roofline, "bf16_matmul_flops", lambda: 1e9)
    monkeypatch.setattr(roofline, "copy_bandwidth", lambda: 10e9)
    monkeypatch.setattr(sys, "argv", ["roofline.py", "--model", tiny_model_dir(), "--dtype", "float32", "--rounds", "3",
                                      "--prompt-len", "64", "--decode-prompt-len", "16", "--decode-tokens", "4",
                                      "--json"])  # fmt: skip
    assert roofline.main() == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rounds = result["prefill_rounds"]
    assert [r["roofline_gflops"] for r in rounds] == [300, 200, 400]
    for r in rounds:
        for name in ("engine_prefill", "hf_prefill"):  # tok/s -> GFLOP/s over the round's own peak
            gflops = result["prefill_gflop"] * r[f"{name}_tok_s"] / 64
            assert abs(gflops / r["roofline_gflops"] - r[f"{name}_of_peak"]) < 1e-9
    median = sorted(rounds, key=lambda r: r["engine_prefill_of_peak"])[1]
    assert result["engine_prefill_of_peak"] == median["engine_prefill_of_peak"]
    assert result["prefill_roofline_gflops"] == median["roofline_gflops"]
    assert result["hf_prefill_tok_s"] == median["hf_prefill_tok_s"]
    assert next(probes, None) is None  # every probe taken, none more
