"""benchmarks/roofline.py on the tiny model, its machine probes replaced by set figures: each prefill's fraction
is taken against the higher of the two peak probes around it, and each system's figure is the median of its
steady prefills (probes within 15% of each other)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import roofline  # noqa: E402


def test_each_prefill_is_measured_against_the_peaks_probed_around_it(tiny_model_dir, monkeypatch, capsys):
    # the start's probe (fp32), then one before the first prefill and one after each: the engine's prefills sit
    # between (100, 300), (290, 280), (50, 270); stock transformers' between (300, 290), (280, 50), (270, 260)
    probes = iter([250e9, 100e9, 300e9, 290e9, 280e9, 50e9, 270e9, 260e9])
    monkeypatch.setattr(roofline, "matmul_flops", lambda dtype, n=2048, repeats=5: next(probes))
    monkeypatch.setattr(roofline, "bf16_matmul_flops", lambda: 1e9)
    monkeypatch.setattr(roofline, "copy_bandwidth", lambda: 10e9)
    monkeypatch.setattr(sys, "argv", ["roofline.py", "--model", tiny_model_dir(), "--dtype", "float32", "--rounds", "3",
                                      "--prompt-len", "64", "--decode-prompt-len", "16", "--decode-tokens", "4",
                                      "--json"])  # fmt: skip
    assert roofline.main() == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rounds = result["prefill_rounds"]
    assert [r["engine_prefill_roofline_gflops"] for r in rounds] == [300, 290, 270]
    assert [r["hf_prefill_roofline_gflops"] for r in rounds] == [300, 280, 270]
    assert [r["engine_prefill_steady"] for r in rounds] == [False, True, False]  # 100 of 300, 50 of 270: moved
    assert [r["hf_prefill_steady"] for r in rounds] == [True, False, True]
    assert [r["roofline_gflops"] for r in rounds] == [300, 290, 270]
    for r in rounds:
        for name in ("engine_prefill", "hf_prefill"):  # tok/s -> GFLOP/s over the prefill's own peak
            gflops = result["prefill_gflop"] * r[f"{name}_tok_s"] / 64
            assert abs(gflops / r[f"{name}_roofline_gflops"] - r[f"{name}_of_peak"]) < 1e-9
    # the engine's figure: its one steady prefill; transformers': the median (upper) of its two steady ones
    assert result["engine_prefill_of_peak"] == rounds[1]["engine_prefill_of_peak"]
    assert result["engine_prefill_steady_rounds"] == 1 and result["hf_prefill_steady_rounds"] == 2
    assert result["prefill_roofline_gflops"] == 290
    upper = max((rounds[0], rounds[2]), key=lambda r: r["hf_prefill_of_peak"])
    assert result["hf_prefill_tok_s"] == upper["hf_prefill_tok_s"]
    assert next(probes, None) is None  # every probe taken, none more


def test_with_no_steady_prefill_the_median_of_all_is_reported():
    rounds = [{"x_tok_s": t, "x_of_peak": t / 100, "x_roofline_gflops": 1.0, "x_steady": False} for t in (30, 10, 20)]
    assert roofline.median_prefill(rounds, "x") == {"x_tok_s": 20, "x_of_peak": 0.2, "x_roofline_gflops": 1.0,
                                                    "x_steady_rounds": 0}
