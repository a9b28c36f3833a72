"""A reference load run of the whole cluster: the same `pdserve bench` load against 1 prefill + 1 decode and
against 2 + 2 workers, one after the other in one run, on the ~60M Llama.

    python benchmarks/cluster_reference.py [--model DIR] [--out DIR] [--num-requests N] [--rates 1,2,4]

Each configuration is a real `pdserve up` (Redis, router, workers as processes; one torch thread per worker);
`pdserve bench` sweeps the request rates (Poisson arrivals, random prompts of --input-len tokens, exactly
--output-len new tokens) and writes its JSON result and plots under OUT/PxD/. Prints one table of both.
On a 2-core machine 2 + 2 workers share the same two cores as 1 + 1, so this shows the cost of the extra
processes here, not the scaling of a real cluster (one GPU per worker).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from local_cluster import pdserve_up

REPO = Path(__file__).resolve().parents[1]


def run_config(model: str, prefill: int, decode: int, bench_args: list[str], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with pdserve_up("--model", model, "--prefill", str(prefill), "--decode", str(decode), "--worker-arg=--threads=1",
                    "--worker-arg=--max-model-len=4096", "--worker-arg=--kv-cache-memory=1e9") as info:
        router = info["router"]
        subprocess.run([sys.executable, "-m", "pdserve", "bench", "--router", router, *bench_args, "--no-progress",
                        "--result-json", str(out / "result.json"), "--plot-dir", str(out)],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        return json.loads((out / "result.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "build" / "llama-60m"))
    ap.add_argument("--out", default=str(REPO / "build" / "cluster-reference"))
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--rates", default="1,2,4")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    if not Path(args.model, "config.json").exists():
        from common.models.tiny import build_tiny

        build_tiny("llama", args.model, size="60m")
    bench = ["--num-requests", str(args.num_requests), "--request-rate", args.rates, "--input-len",
             str(args.input_len), "--output-len", str(args.output_len), "--seed", "0"]  # fmt: skip
    print(f"{'workers':>7} {'rate':>5} | {'done':>4} {'fail':>4} | {'TTFT p50':>9} {'p90':>8} {'p99':>8} | "
          f"{'TPOT p50':>9} {'ITL p99':>8} | {'E2E p50':>8} | {'req/s':>6} {'tok/s':>6}")
    for prefill, decode in ((1, 1), (2, 2)):
        result = run_config(args.model, prefill, decode, bench, Path(args.out) / f"{prefill}x{decode}")
        for run in result["runs"]:
            t, tp, itl, e2e = run["ttft_ms"], run["tpot_ms"], run["itl_ms"], run["e2e_ms"]
            print(f"{prefill}P+{decode}D {run['request_rate']!s:>5} | {run['completed']:>4} {run['failed']:>4} | "
                  f"{t['p50']:7.0f}ms {t['p90']:6.0f}ms {t['p99']:6.0f}ms | {tp['p50']:7.1f}ms {itl['p99']:6.1f}ms | "
                  f"{e2e['p50']:6.0f}ms | {run['request_throughput']:6.2f} {run['output_throughput']:6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
