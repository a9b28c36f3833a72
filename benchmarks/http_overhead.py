"""What the OpenAI-compatible HTTP front costs against the gRPC API: the same `pdserve bench` load through
each, interleaved in one run against one cluster (1 prefill + 1 decode, the ~60M Llama).

    python benchmarks/http_overhead.py [--model DIR] [--rounds 3] [--num-requests 16] [--concurrency 4]

Reports, per protocol, the median over rounds of output tokens/s and TTFT p50/p90, and the HTTP/gRPC ratios.
HTTP streams server-sent events from the same router process (/v1/completions, stream=true).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from local_cluster import pdserve_up

REPO = Path(__file__).resolve().parents[1]


def bench(target: str, http: bool, args, seed: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        argv = [sys.executable, "-m", "pdserve", "bench", "--router", target, "--num-requests", str(args.num_requests),
                "--concurrency", str(args.concurrency), "--input-len", str(args.input_len), "--output-len",
                str(args.output_len), "--seed", str(seed), "--no-progress", "--result-json", out.name]
        if http:
            argv.append("--http")
        subprocess.run(argv, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "build" / "llama-60m"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    if not Path(args.model, "config.json").exists():
        from common.models.tiny import build_tiny

        build_tiny("llama", args.model, size="60m")
    with pdserve_up("--model", args.model, "--worker-arg=--threads=1", "--worker-arg=--max-model-len=4096",
                    "--worker-arg=--kv-cache-memory=1e9") as info:
        router, http = info["router"], info["http"]
        bench(router, False, args, seed=99)  # warm-up
        runs: dict[str, list[dict]] = {"grpc": [], "http": []}
        for r in range(args.rounds):
            runs["grpc"].append(bench(router, False, args, seed=r))
            runs["http"].append(bench(http, True, args, seed=r))
    med = {p: {"tok_s": statistics.median(x["output_throughput"] for x in rs),
               "ttft_p50": statistics.median(x["ttft_ms"]["p50"] for x in rs),
               "ttft_p90": statistics.median(x["ttft_ms"]["p90"] for x in rs),
               "failed": sum(x["failed"] for x in rs)} for p, rs in runs.items()}  # fmt: skip
    for p, m in med.items():
        print(f"{p:>4}: {m['tok_s']:7.1f} output tok/s, TTFT p50 {m['ttft_p50']:7.1f} ms, p90 {m['ttft_p90']:7.1f} ms, "
              f"{m['failed']} failed")
    print(f"HTTP / gRPC: throughput {med['http']['tok_s'] / med['grpc']['tok_s']:.3f}x, "
          f"TTFT p50 {med['http']['ttft_p50'] / med['grpc']['ttft_p50']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
