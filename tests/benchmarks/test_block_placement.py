"""benchmarks/block_placement.py on the tiny model: a busy decode worker's reservations come in long stretches of
consecutive blocks under contiguous placement and scattered under lru, with the prefix cache still hitting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_contiguous_placement_keeps_a_busy_workers_blocks_together(tiny_model_dir):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "block_placement.py"), "--model", tiny_model_dir(), "--json",
         "--requests", "90", "--warmup", "30", "--concurrency", "12", "--decode-blocks", "640",
         "--prefill-blocks", "400", "--max-prompt", "600", "--max-out", "96", "--system-len", "128"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["placement"]: r for r in json.loads(proc.stdout)["results"]}
    contiguous, lru = results["contiguous"], results["lru"]
    assert contiguous["requests_measured"] == lru["requests_measured"] == 60
    assert contiguous["decode_blocks_per_stretch"] >= 4 * lru["decode_blocks_per_stretch"], results
    assert contiguous["nixl_descs_per_layer"] * 3 <= lru["nixl_descs_per_layer"], results
    assert contiguous["prefix_hit_rate"] > 0.1 and lru["prefix_hit_rate"] > 0.1, results
