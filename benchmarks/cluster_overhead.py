"""The cluster's overhead over the bare engine for concurrent streams, measured side by side in one run.

    python benchmarks/cluster_overhead.py [--model DIR] [--streams 16] [--new-tokens 128] [--rounds 2] [--json]

The same --streams requests (prompts of --prompt-len random tokens, --new-tokens new tokens each, greedy, EOS
ignored) run (1) on the engine alone in this process (2 threads, all submitted at once) and (2) through the
router of ``pdserve up --prefill 1 --decode 1`` (real processes, Redis, gRPC; one client thread per stream,
streaming), rounds interleaved, median tokens/s of each. Both sides have the machine's two cores: the
workers run 2 torch threads each, and router, Redis and the client threads share the same cores, as the issue
asks. Overhead = 1 - cluster / engine. Also checks the cluster's tokens equal the engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from local_cluster import pdserve_up  # noqa: E402

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import LLMEngine  # noqa: E402
from common.engine.loader import load_model  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.client import Client  # noqa: E402


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_engine(engine: LLMEngine, prompts, new: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    return time.perf_counter() - t0, [r.token_ids for r in results]


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of each process under ``root``, summed by role: router, prefill,
    decode, redis, other (``pdserve up`` itself; the role is read from the command line)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in process_tree(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        service = re.search(r"-m pdserve (?:--log-level \S+ )?(router|prefill|decode) ", cmd)
        role = service.group(1) if service else "redis" if "redis-server" in cmd else "other"
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def run_cluster(router: str, prompts, new: int) -> tuple[float, list[list[int]], list[int]]:
    """Wall time, each stream's tokens, and how many messages each stream took."""
    tokens: list[list[int]] = [[] for _ in prompts]
    messages = [0] * len(prompts)
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        try:
            with Client(router, timeout_s=600) as client:
                start.wait()
                for piece in client.stream(prompts[i], max_tokens=new, temperature=0.0, ignore_eos=True):
                    tokens[i] += list(piece.token_ids)
                    messages[i] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return took, tokens, messages


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "build" / "llama-60m"), help="built with --size 60m if missing")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefill-threads", type=int, default=2, help="torch threads of the prefill worker")
    ap.add_argument("--decode-threads", type=int, default=2, help="torch threads of the decode worker")
    ap.add_argument("--stream-interval", type=int, default=1, help="the decode worker's --stream-interval")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    if not Path(args.model, "config.json").exists():
        from common.models.tiny import build_tiny

        build_tiny("llama", args.model, size="60m")
    loaded = load_model(args.model, dtype="float32")
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=64, max_model_len=1024, prefix_caching=False))
    engine.generate([[5] * 64], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    useful = args.streams * args.new_tokens
    engine_tps, cluster_tps, per_message, equal = [], [], [], True
    cpu_seconds: list[dict[str, float]] = []  # each round's CPU seconds by process role, during the cluster run
    with tempfile.TemporaryDirectory() as logs, pdserve_up(
        "--model", args.model, "--prefill", "1", "--decode", "1", "--log-dir", logs,
        f"--prefill-arg=--threads={args.prefill_threads}", f"--decode-arg=--threads={args.decode_threads}",
        f"--decode-arg=--stream-interval={args.stream_interval}",
        "--worker-arg=--max-model-len=1024", "--worker-arg=--no-prefix-caching",
    ) as cluster:  # fmt: skip
        warm = make_prompts(2, 64, engine.vocab_size, seed=99)
        run_cluster(cluster["router"], warm, 4)
        for r in range(args.rounds):
            prompts = make_prompts(args.streams, args.prompt_len, engine.vocab_size, seed=r)
            t_e, out_e = run_engine(engine, prompts, args.new_tokens)
            cpu0, client0 = cpu_by_role(cluster["proc"].pid), time.process_time()
            t_c, out_c, messages = run_cluster(cluster["router"], prompts, args.new_tokens)
            cpu1, client1 = cpu_by_role(cluster["proc"].pid), time.process_time()
            cpu = {role: round(cpu1[role] - cpu0.get(role, 0.0), 2) for role in sorted(cpu1)}
            cpu["client"] = round(client1 - client0, 2)
            cpu_seconds.append(cpu)
            engine_tps.append(useful / t_e)
            cluster_tps.append(useful / t_c)
            per_message.append(useful / sum(messages))
            equal &= out_c == out_e
            if not args.json:
                print(f"round {r}: engine {useful / t_e:6.1f} tok/s, cluster {useful / t_c:6.1f} tok/s "
                      f"({useful / sum(messages):.2f} tokens a message), equal {out_c == out_e}; "
                      f"CPU s during it {cpu}", flush=True)
    e, c = statistics.median(engine_tps), statistics.median(cluster_tps)
    result = {"streams": args.streams, "stream_interval": args.stream_interval, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens,
              "engine_tok_s": e, "cluster_tok_s": c, "overhead": 1 - c / e,
              "tokens_per_message": statistics.median(per_message), "equal": equal, "cpu_seconds": cpu_seconds}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"median: engine {e:.1f} tok/s, cluster {c:.1f} tok/s, overhead {1 - c / e:.1%}; outputs equal {equal}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
