"""The KV hand-off across hosts: time to first token when prefill and decode workers sit on different hosts joined
by a link of a given rate, per KV transport.

    python benchmarks/across_hosts.py [--model DIR] [--prompt-lens 512,2048] [--rates ,10gbit,1gbit,200mbit,100mbit]
                                      [--rounds 3] [--json]

Virtual hosts (``tests/netns_hosts.py``: network namespaces with their own hostname, /dev/shm and PIDs; needs
root): Redis and the router on one, two prefill workers (``--kv-transport grpc`` and ``nixl``) on one each, a
decode worker (``--kv-nixl``) on another; every worker 2 torch threads. Each worker host's link is limited to the
rate each way (tc's token bucket; an empty rate: unlimited, a veth pair at memory speed). Per rate, prompt length
and round, one request of fresh random tokens (nothing cached) through each prefill worker (the router alternates
them), 2 new tokens, greedy: time to first token at the client, and from the prefill worker's metrics the prompt's
compute time (``request_prefill_time_seconds``) and the KV transfer's (``kv_transfer_seconds``: first chunk
queued to the decode worker's acknowledgement); medians over the rounds. The transfer runs layer by layer beside
the prompt's compute: what the link adds to the first token is what does not fit beside it.

The machine's two cores carry all of it; the link is what changes between rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from bench_models import model_dir  # noqa: E402

from pdserve.client import Client  # noqa: E402
from tests.netns_hosts import VirtualHosts, parse_rate, start_pdserve, unavailable_reason, wait_serving  # noqa: E402
from tests.services.probe import metric  # noqa: E402

PREFILL = {"prefill-grpc": "grpc", "prefill-nixl": "nixl"}  # worker id -> --kv-transport


def prefill_figures(address: str, transport: str) -> tuple[float, float, float]:
    """The prefill worker's running totals: prompt compute seconds, KV transfer seconds, KV bytes sent."""
    return (metric(address, "pdserve:request_prefill_time_seconds_sum"),
            metric(address, "pdserve:kv_transfer_seconds_sum", transport=transport),
            metric(address, "pdserve:kv_transfer_bytes_total", direction="sent"))  # fmt: skip


def one_request(info: dict, prompt: list[int]) -> tuple[str, dict]:
    """One request; which prefill worker took it and its figures (seconds, MB)."""
    before = {w: prefill_figures(info["metrics"][w], t) for w, t in PREFILL.items()}
    with Client(info["router"], timeout_s=300) as client:
        t0 = time.perf_counter()
        ttft, worker = None, ""
        for piece in client.stream(prompt, max_tokens=2, temperature=0.0, ignore_eos=True):
            ttft = ttft if ttft is not None else time.perf_counter() - t0
            worker = piece.prefill_worker_id or worker
    after = prefill_figures(info["metrics"][worker], PREFILL[worker])
    compute, transfer, sent = (a - b for a, b in zip(after, before[worker], strict=True))
    return worker, {"ttft_s": ttft, "compute_s": compute, "transfer_s": transfer, "kv_mb": sent / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model directory (default: build/llama-60m, built if missing)")
    ap.add_argument("--prompt-lens", default="512,2048")
    ap.add_argument("--rates", default=",10gbit,1gbit,200mbit,100mbit", help="link rates (tc syntax; empty: unlimited)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args()
    if why := unavailable_reason():
        print(f"across_hosts: {why}", file=sys.stderr)
        return 2
    rates = args.rates.split(",")
    for rate in rates:
        if rate:
            parse_rate(rate)
    lens = [int(n) for n in args.prompt_lens.split(",")]
    model = model_dir(args.model, "60m")
    vocab = json.loads(Path(model, "config.json").read_text())["vocab_size"]
    flags = ["--threads", "2", "--kv-cache-memory", "1e9", "--max-model-len", str(max(lens) + 16)]
    layout = {w: ("prefill", w, [*flags, "--kv-transport", t]) for w, t in PREFILL.items()}
    layout["decode-0"] = ("decode", "decode", [*flags, "--kv-nixl"])
    rows = []
    with tempfile.TemporaryDirectory() as logs, VirtualHosts(["svc", *PREFILL, "decode"]) as hosts:
        info = start_pdserve(hosts, model, layout, Path(logs))
        wait_serving(info, layout, Path(logs), timeout_s=300)
        g = torch.Generator().manual_seed(0)
        for n in lens:  # warm-up: both pairs, each length (first KV channels, kernels, allocations)
            for _ in PREFILL:
                one_request(info, torch.randint(4, vocab, (n,), generator=g).tolist())
        for rate in rates:
            for host in (*PREFILL, "decode"):
                hosts.shape(host, rate)
            for n in lens:
                got: dict[str, list[dict]] = {w: [] for w in PREFILL}
                for _ in range(args.rounds * len(PREFILL)):
                    worker, figures = one_request(info, torch.randint(4, vocab, (n,), generator=g).tolist())
                    got[worker].append(figures)
                for worker, transport in PREFILL.items():
                    med = {k: round(statistics.median(f[k] for f in got[worker]), 4) for k in got[worker][0]}
                    rows.append({"rate": rate or "unlimited", "prompt_tokens": n, "transport": transport,
                                 "requests": len(got[worker]), **med})  # fmt: skip
                    if not args.json:
                        r = rows[-1]
                        print(f"{r['rate']:>10} {n:5d} tokens {transport:5s}: TTFT {r['ttft_s']:.3f} s, prompt compute "
                              f"{r['compute_s']:.3f} s, KV transfer {r['transfer_s']:.3f} s, {r['kv_mb']:.1f} MB "
                              f"({r['requests']} requests)", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps({"model": model, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
