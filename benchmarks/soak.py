"""Soak: memory growth of every service over a long run of requests (ten thousand by default).

    python benchmarks/soak.py [--model DIR] [--num-requests 10000] [--concurrency 8] [--prefill 1] [--decode 1]
                              [--sample-every 500] [--warmup 1000] [--json FILE]

Starts a real `pdserve up` (Redis, router, workers as processes) and sends a mixed load through the router:
random prompts of 16-256 tokens, a third of them behind a shared 64-token prefix (the prefix cache fills and
evicts), 8-32 new tokens each; every 10th request goes through the OpenAI HTTP front, every 15th is cancelled
after its first token (cancellation frees KV on both workers). Every --sample-every requests it reads each
process's resident memory (VmRSS from /proc) and each worker's KV blocks in use.

The first --warmup requests fill allocator arenas, caches and pools (the KV pool's pages are touched as
its blocks are first used, so it is kept small), so growth is measured from there:
the table gives each service's RSS after warm-up and at the end, the difference, and the least-squares slope
over the samples after warm-up in MiB per 10,000 requests (a leak shows as a steady slope; noise as a
scatter around zero). Not a test: the figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from local_cluster import pdserve_up  # noqa: E402

from common.state.redis_client import connect  # noqa: E402
from common.state.registry import WorkerRegistry  # noqa: E402
from pdserve.client import Client  # noqa: E402


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc/*/stat)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class Load:
    """The request mix; ``one(k)`` runs request k and returns how it ended ("ok", "cancelled", or an error)."""

    def __init__(self, router: str, http: str, seed: int) -> None:
        self.router, self.http = router, http
        with urllib.request.urlopen(f"http://{http}/v1/models", timeout=30) as reply:
            self.model = json.loads(reply.read())["data"][0]["id"]
        self.rng = random.Random(seed)
        self.prefix = [self.rng.randrange(20, 3000) for _ in range(64)]
        self.local = threading.local()

    def _client(self) -> Client:
        if not hasattr(self.local, "client"):
            self.local.client = Client(self.router, timeout_s=120)
        return self.local.client

    def one(self, k: int) -> str:
        rng = random.Random(k)
        prompt = [rng.randrange(20, 3000) for _ in range(rng.randrange(16, 256))]
        if k % 3 == 0:
            prompt = self.prefix + prompt[:192]
        max_tokens = rng.randrange(8, 33)
        try:
            if k % 10 == 0:
                body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                   "temperature": 0}).encode()
                request = urllib.request.Request(f"http://{self.http}/v1/completions", body,
                                                 {"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=120) as reply:
                    reply.read()
                return "ok"
            stream = self._client().stream(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for i, _ in enumerate(stream):
                if k % 15 == 0 and i == 0:
                    stream.close()  # stops iterating: the client cancels the call
                    return "cancelled"
            return "ok"
        except Exception as exc:  # noqa: BLE001 - counted and reported
            return type(exc).__name__


def slope_per_10k(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (requests, MiB) points, in MiB per 10,000 requests."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return 0.0 if var == 0 else 10_000 * sum((x - mx) * (y - my) for x, y in points) / var


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    ap.add_argument("--num-requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--sample-every", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", type=float, default=5e7,
                    help="KV bytes per worker (small: the pool is fully touched during the warm-up)")
    ap.add_argument("--json", default=None, help="also write the samples and the summary here")
    args = ap.parse_args()

    up_args = ["--prefill", str(args.prefill), "--decode", str(args.decode), "--worker-arg=--threads=1",
               f"--worker-arg=--kv-cache-memory={args.kv_cache_memory:g}"]  # fmt: skip
    if args.model:
        up_args += ["--model", args.model]
    with pdserve_up(*up_args) as info:
        up, router, http, redis_url = info["proc"], info["router"], info["http"], info["redis"]
        registry = WorkerRegistry(connect(redis_url))
        workers = registry.list_workers()
        procs = {w.id: w.pid for w in workers}
        procs.update({"router": pid for pid in children(up.pid) if " router " in cmdline(pid)})
        load = Load(router, http, args.seed)
        samples: list[dict] = []
        outcomes: dict[str, int] = {}

        def sample(done: int) -> None:
            used = {w.id: w.kv_blocks_used for w in registry.list_workers()}
            samples.append({"requests": done, "rss_mib": {name: rss_mib(pid) for name, pid in procs.items()},
                            "kv_blocks_used": used, "at_s": round(time.monotonic() - t0, 1)})

        t0 = time.monotonic()
        sample(0)
        with ThreadPoolExecutor(args.concurrency) as pool:
            for start in range(0, args.num_requests, args.sample_every):
                batch = range(start, min(args.num_requests, start + args.sample_every))
                for outcome in pool.map(load.one, batch):
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                time.sleep(1.5)  # let cancelled requests' KV go back and the heartbeat catch up
                sample(batch.stop)
                print(f"{batch.stop:>6} requests, {samples[-1]['at_s']:7.1f} s: "
                      + ", ".join(f"{n} {v:.0f} MiB" for n, v in samples[-1]["rss_mib"].items() if v), flush=True)
        took_s = time.monotonic() - t0
        settle_s = None  # every request has ended: how long until no KV block is in use anywhere
        while time.monotonic() - t0 - took_s < 30:
            if all(w.kv_blocks_used == 0 for w in registry.list_workers()):
                settle_s = time.monotonic() - t0 - took_s
                break
            time.sleep(0.25)

    after = [s for s in samples if s["requests"] >= args.warmup] or samples[-1:]
    summary = {}
    print(f"\nsoak: {args.num_requests} requests at concurrency {args.concurrency} in {took_s:.0f} s "
          f"({args.num_requests / took_s:.1f} req/s); outcomes {outcomes}")
    print(f"{'service':<12} {'RSS @warm-up':>13} {'RSS @end':>10} {'growth':>9} {'slope/10k':>10}")
    for name in procs:
        points = [(s["requests"], s["rss_mib"][name]) for s in after if s["rss_mib"][name] is not None]
        if not points:
            continue
        first, last = points[0][1], points[-1][1]
        summary[name] = {"rss_warm_mib": round(first, 1), "rss_end_mib": round(last, 1),
                         "growth_mib": round(last - first, 1), "slope_mib_per_10k": round(slope_per_10k(points), 1)}
        print(f"{name:<12} {first:>10.1f} MiB {last:>6.1f} MiB {last - first:>+6.1f} MiB "
              f"{summary[name]['slope_mib_per_10k']:>+7.1f} MiB")
    print(f"KV blocks in use after the last request: {samples[-1]['kv_blocks_used']}; "
          + (f"none {settle_s:.1f} s after it" if settle_s is not None else "STILL IN USE 30 s after it"))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "took_s": took_s, "kv_settle_s": settle_s,
                                               "outcomes": outcomes, "summary": summary, "samples": samples},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
