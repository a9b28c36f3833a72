"""benchmarks/across_hosts.py on the tiny model: both transports hand the KV off across virtual hosts, the bytes are
the model's KV of the prompt, and a slow link shows as it must: no transfer faster than the link allows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.kv_transfer import nixl
from tests.netns_hosts import MIN_BURST_BYTES, unavailable_reason

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(bool(unavailable_reason() or nixl.unavailable_reason()),
                    reason=unavailable_reason() or nixl.unavailable_reason() or "-")  # fmt: skip
def test_kv_hand_off_across_hosts_by_link_rate(tiny_model_dir):
    model = tiny_model_dir()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "across_hosts.py"), "--model", model, "--json", "--rounds", "1",
         "--rates", ",20mbit", "--prompt-lens", "1024"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)["rows"]
    assert {(r["rate"], r["transport"]) for r in rows} == {(rate, t) for rate in ("unlimited", "20mbit")
                                                           for t in ("grpc", "nixl")}  # fmt: skip
    config = json.loads(Path(model, "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_mb = 1024 * config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4 / 1e6  # fp32
    for r in rows:
        assert r["requests"] == 1 and r["kv_mb"] == pytest.approx(kv_mb, rel=0.05), r
        assert 0 < r["compute_s"] <= r["ttft_s"] and r["transfer_s"] > 0, r
        if r["rate"] == "20mbit":  # the link's floor: past the first burst, 20 Mbit/s (2.1 MB: 0.73 s at least)
            floor_s = (kv_mb - MIN_BURST_BYTES / 1e6) * 8 / 20
            assert r["transfer_s"] >= 0.9 * floor_s and r["ttft_s"] >= 0.9 * floor_s, r
