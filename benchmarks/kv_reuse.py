"""What KV reuse saves: a shared-prefix workload and a multi-turn workload through the cluster with prefix
caching (and sessions) on, then off, in one run (1 prefill + 1 decode, the ~60M Llama).

    python benchmarks/kv_reuse.py [--model DIR]

Shared prefix: 16 requests of 1024 prompt tokens, 90% of them a prefix shared by all, 16 new tokens,
concurrency 2. Multi-turn: 4 sessions of 4 turns (256 new user tokens a turn, 16 new tokens), concurrency 2,
each turn carrying its session id. Reports TTFT p50/p90, the prefix hit rate and the prompt tokens the
cache saved (from the workers' /metrics), for each workload with the feature on and off.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from local_cluster import pdserve_up
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = {
    "shared-prefix": ["--num-requests", "16", "--concurrency", "2", "--input-len", "1024", "--output-len", "16",
                      "--shared-prefix-ratio", "0.9"],
    "multi-turn": ["--num-requests", "16", "--turns", "4", "--concurrency", "2", "--input-len", "256",
                   "--output-len", "16"],
}  # fmt: skip


def scrape(addresses: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for address in addresses:
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def run(model: str, caching: bool) -> dict:
    args = ["--model", model, "--worker-arg=--threads=1", "--worker-arg=--max-model-len=4096",
            "--worker-arg=--kv-cache-memory=1e9"]
    if not caching:
        args.append("--worker-arg=--no-prefix-caching")
    with pdserve_up(*args) as info:
        status = subprocess.run([sys.executable, "-m", "pdserve", "status", "--json", "--redis-url", info["redis"]],
                                cwd=REPO, capture_output=True, text=True, check=True)
        workers = [w["metrics_address"] for w in json.loads(status.stdout)["workers"]]
        out = {}
        for name, load in WORKLOADS.items():
            before = scrape(workers)
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, "-m", "pdserve", "bench", "--router", info["router"], *load,
                                "--seed", "0", "--no-progress", "--result-json", f.name], cwd=REPO, check=True,
                               stdout=subprocess.DEVNULL)  # fmt: skip
                result = json.loads(Path(f.name).read_text())
            after = scrape(workers)

            def delta(key):
                return after.get(key, 0.0) - before.get(key, 0.0)

            queries = delta("pdserve:prefix_cache_queries_total")
            out[name] = {"ttft_p50": result["ttft_ms"]["p50"], "ttft_p90": result["ttft_ms"]["p90"],
                         "hit_rate": delta("pdserve:prefix_cache_hits_total") / queries if queries else 0.0,
                         "saved": delta("pdserve:prefix_cache_hits_total"), "failed": result["failed"],
                         "tok_s": result["output_throughput"]}  # fmt: skip
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "build" / "llama-60m"))
    args = ap.parse_args()
    if not Path(args.model, "config.json").exists():
        sys.path.insert(0, str(REPO))
        from common.models.tiny import build_tiny

        build_tiny("llama", args.model, size="60m")
    on, off = run(args.model, True), run(args.model, False)
    for name in WORKLOADS:
        a, b = on[name], off[name]
        print(f"{name}: TTFT p50 {a['ttft_p50']:.0f} ms with reuse vs {b['ttft_p50']:.0f} ms without "
              f"({a['ttft_p50'] / b['ttft_p50']:.2f}x), p90 {a['ttft_p90']:.0f} vs {b['ttft_p90']:.0f} ms; "
              f"hit rate {a['hit_rate']:.0%}, {a['saved']:.0f} prompt tokens not recomputed; "
              f"{a['tok_s']:.1f} vs {b['tok_s']:.1f} output tok/s; failed {a['failed']}/{b['failed']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
