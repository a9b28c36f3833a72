"""Two checkouts' clusters side by side in one run: tokens/s of the same streams, rounds alternated, the median
ratio of each round's pair. On a noisy machine (these VMs' speed drifts by 10-30% within minutes) a change to
the serving path is only visible this way, not as the difference of two separate runs.

    git worktree add /tmp/base HEAD~1      # the other side (its own .venv or none: this one's Python runs both)
    python benchmarks/cluster_ab.py --base /tmp/base [--streams 16] [--new-tokens 128] [--rounds 8] [--json]

Each side is ``pdserve up --prefill 1 --decode 1`` started from its own checkout (real processes, Redis, gRPC),
both up for the whole run (an idle cluster costs only heartbeats); each round runs the same --streams
streaming requests (prompts of --prompt-len random tokens, --new-tokens each, greedy, EOS ignored) through one
side's router and then the other's, the order flipped every round. Also checks both sides return the same
tokens. Ratio > 1: this checkout is faster. Extra ``pdserve up`` arguments go after ``--``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cluster_overhead import make_prompts, run_cluster  # noqa: E402


@contextmanager
def cluster_from(checkout: Path, model: str, log_dir: str, extra: list[str]):
    """``pdserve up`` run from ``checkout`` (this Python); yields its router address. Each checkout builds and
    loads its own CPU kernels (a torch extension directory of its own: the two may differ)."""
    kernels = Path(tempfile.gettempdir(), "pdserve-ab-kernels", hashlib.sha256(str(checkout.resolve()).encode())
                   .hexdigest()[:12])  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--model", model, "--prefill", "1", "--decode", "1",
         "--log-dir", log_dir, "--worker-arg=--max-model-len=1024", "--worker-arg=--no-prefix-caching", *extra],
        cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(kernels)},
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        if not line.startswith("pdserve ready: "):
            raise RuntimeError(f"pdserve up in {checkout} failed: {line!r}")
        yield line.split()[2]
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, type=Path, help="the other checkout (e.g. a git worktree)")
    ap.add_argument("--model", default=str(REPO / "build" / "llama-60m"), help="built with --size 60m if missing")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("up_args", nargs="*", help="more `pdserve up` arguments for both sides (after --)")
    args = ap.parse_args()
    if not (args.base / "pdserve").is_dir():
        ap.error(f"--base {args.base} is not a pdserve checkout")
    if not Path(args.model, "config.json").exists():
        from common.models.tiny import build_tiny

        build_tiny("llama", args.model, size="60m")
    vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
    useful = args.streams * args.new_tokens
    rounds, equal = [], True
    with ExitStack() as stack:
        sides = {name: stack.enter_context(cluster_from(path, args.model, stack.enter_context(
            tempfile.TemporaryDirectory()), args.up_args)) for name, path in (("base", args.base), ("this", REPO))}
        warm = make_prompts(2, 64, vocab, seed=99)
        for router in sides.values():
            run_cluster(router, warm, 4)
        for r in range(args.rounds):
            prompts = make_prompts(args.streams, args.prompt_len, vocab, seed=r)
            took, tokens = {}, {}
            for name in (("base", "this") if r % 2 == 0 else ("this", "base")):
                took[name], tokens[name], _messages = run_cluster(sides[name], prompts, args.new_tokens)
            equal &= tokens["base"] == tokens["this"]
            row = {name: useful / took[name] for name in took}
            row["ratio"] = row["this"] / row["base"]
            rounds.append(row)
            if not args.json:
                print(f"round {r}: base {row['base']:6.1f} tok/s, this {row['this']:6.1f} tok/s, "
                      f"ratio {row['ratio']:.3f}", flush=True)
    result = {"streams": args.streams, "new_tokens": args.new_tokens, "rounds": rounds,
              "median_ratio": statistics.median(r["ratio"] for r in rounds), "equal": equal}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"median ratio this/base {result['median_ratio']:.3f} over {len(rounds)} rounds; outputs equal {equal}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
