"""How scattered a busy worker's KV blocks get, under each block placement (``--kv-block-placement``).

Two real engines in one process stand for a prefill worker and a decode worker: requests arrive to keep
``--concurrency`` decoding; each is prefilled on the first (``prefill_only``, its blocks then given up as a
prefill worker does after the hand-off) while the second reserves blocks for its prompt's KV, admits it and
decodes ``--min-out``..``--max-out`` tokens (one block more per ``block_size`` tokens, as every decode step
does). Prompts share one of a few system prompts (``--shared``) before random tokens, so both prefix caches
work. The KV itself is not moved (the decode engine decodes over zeros): what is measured is which block ids
the engines' pools hand out. Per placement, after the warm-up requests:

- blocks per stretch: the mean length of runs of consecutive ids in the prefill side's new blocks and in the
  decode side's reservations;
- NIXL descriptors per layer: a block transfer writes one descriptor per (K|V, KV head, stretch consecutive on
  both sides) (``common.kv_transfer.blocks.write_descs``); the mean per request, and per 100 blocks;
- prefix hit rate: the share of prompt tokens the prefill engine found cached;
- session retention: as each request arrives, the share of one of the 8 conversations the decode engine
  finished last (prompt and output, its full blocks) that its cache still holds: what a session's next turn,
  prefilled on its decode worker, would find.

  python benchmarks/block_placement.py [--model DIR | --size tiny] [--requests 400] [--concurrency 24]
                                       [--decode-blocks 1536] [--prefill-blocks 1024] [--eligible Q] [--json]

``--alloc-cost``: instead, what one allocation of n blocks (and its free) costs each placement in pools of 4,096
and 65,536 blocks, two thirds in use, the free ones scattered.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_models import model_dir  # noqa: E402

from common.engine import block_pool  # noqa: E402
from common.engine.block_pool import PLACEMENTS  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import LLMEngine  # noqa: E402
from common.engine.loader import load_model  # noqa: E402
from common.engine.prefix_cache import block_hashes  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402


def stretches(*sides: list[int]) -> int:
    """Runs of blocks consecutive on every side (the i-th block of each side belongs together)."""
    breaks = np.zeros(max(len(sides[0]) - 1, 0), bool)
    for ids in sides:
        breaks |= np.diff(np.asarray(ids, np.int64)) != 1
    return int(breaks.sum()) + 1 if len(sides[0]) else 0


def run(loaded, placement: str, args) -> dict:
    """Drive a prefill and a decode engine with ``placement`` through ``args.requests`` requests."""
    common = dict(max_num_seqs=max(64, args.concurrency), max_model_len=args.max_model_len, prefix_caching=True,
                  kv_block_placement=placement)  # fmt: skip
    prefill = LLMEngine(loaded, EngineConfig(num_kv_blocks=args.prefill_blocks, **common))
    decode = LLMEngine(loaded, EngineConfig(num_kv_blocks=args.decode_blocks, **common))
    bs = decode.kv_spec.block_size
    heads = decode.kv_spec.num_kv_heads
    rng = random.Random(args.seed)
    vocab = min(loaded.config.vocab_size, 4000)
    systems = [[rng.randrange(10, vocab) for _ in range(args.system_len)] for _ in range(args.systems)]
    prefill_runs, decode_runs, pair_runs, num_blocks, cached, prompt_tokens = [], [], [], [], 0, 0
    live, finished, retained = {}, deque(maxlen=8), []  # decode's requests; conversations ended; shares held
    arrived = steps = 0
    started = time.perf_counter()
    while arrived < args.requests or decode.has_unfinished_requests():
        while arrived < args.requests and decode.scheduler.num_running + decode.num_requests_waiting < args.concurrency:
            if arrived >= args.warmup and finished:
                names = rng.choice(finished)
                retained.append(len(decode.block_pool.lookup(names)) / len(names))
            length = rng.randint(args.min_prompt, args.max_prompt)
            prompt = list(systems[rng.randrange(len(systems))]) if rng.random() < args.shared else []
            prompt = (prompt + [rng.randrange(10, vocab) for _ in range(length)])[:length]
            rid = f"r{arrived}"
            sampling = SamplingParams(max_new_tokens=rng.randint(args.min_out, args.max_out), temperature=0.0,
                                      ignore_eos=True)  # fmt: skip
            prefill.add_request(prompt, sampling, request_id=rid, prefill_only=True)
            while prefill._requests[rid].status.value != "prefilled":
                prefill.step()
            request = prefill._requests[rid]
            src = list(request.block_ids[: -(-length // bs)])
            new = src[request.num_cached_tokens // bs :]
            handoff = prefill.export_kv(rid, with_kv=False)
            while not decode.block_pool.can_allocate(-(-length // bs)):  # a router would wait for room too
                decode.step()
            dst = decode.reserve_kv(rid, length, lease_s=600.0)
            decode.admit_reserved(rid, prompt, handoff.output_token_ids, sampling)
            live[rid] = decode._requests[rid]
            if arrived >= args.warmup:
                prefill_runs.append((len(new), stretches(new)))
                decode_runs.append((len(dst), stretches(dst)))
                pair_runs.append(stretches(src, dst))
                num_blocks.append(len(dst))
                cached += request.num_cached_tokens
                prompt_tokens += length
            arrived += 1
        decode.step()
        steps += 1
        for rid in [rid for rid, r in live.items() if r.status.value == "finished"]:
            r = live.pop(rid)
            finished.append(block_hashes(r.all_token_ids[: r.num_computed_tokens], bs))

    def per_stretch(runs):
        return sum(n for n, _ in runs) / max(1, sum(s for _, s in runs))

    descs = [2 * heads * s for s in pair_runs]
    return {
        "placement": placement,
        "requests_measured": len(pair_runs),
        "decode_steps": steps,
        "seconds": round(time.perf_counter() - started, 1),
        "prefill_blocks_per_stretch": round(per_stretch(prefill_runs), 2),
        "decode_blocks_per_stretch": round(per_stretch(decode_runs), 2),
        "blocks_per_request": round(statistics.mean(num_blocks), 1),
        "nixl_descs_per_layer": round(statistics.mean(descs), 1),
        "nixl_descs_per_100_blocks": round(100 * sum(descs) / sum(num_blocks), 1),
        "prefix_hit_rate": round(cached / max(1, prompt_tokens), 3),
        "session_retention": round(statistics.mean(retained), 3) if retained else None,
    }


def alloc_cost() -> None:
    """Microseconds per allocate + free of n blocks, per placement and pool size (no model)."""
    for num_blocks in (4096, 65536):
        for placement in PLACEMENTS:
            for named in (False, True):
                pool = block_pool.BlockPool(num_blocks, placement)
                held = [pool.allocate(1) for _ in range(num_blocks - num_blocks // 3)]
                random.Random(0).shuffle(held)
                for i, blocks in enumerate(held[: len(held) // 2]):
                    if named:
                        pool.name(blocks[0], str(i).encode())
                    pool.free(blocks)
                costs = []
                for n in (2, 64, 512):
                    start, count = time.perf_counter(), 0
                    while time.perf_counter() - start < 0.3:
                        pool.free(pool.allocate(n))
                        count += 1
                    costs.append(f"n={n}: {(time.perf_counter() - start) / count * 1e6:.0f} us")
                print(f"{num_blocks} blocks, {placement}, {'named' if named else 'unnamed'}: {', '.join(costs)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="", help="model directory (default: build/llama-SIZE)")
    parser.add_argument("--size", default="tiny", choices=["tiny", "60m", "350m"])
    parser.add_argument("--placements", default=",".join(PLACEMENTS))
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=100, help="requests not measured (the pools fill up first)")
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--decode-blocks", type=int, default=1536)
    parser.add_argument("--prefill-blocks", type=int, default=1024)
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=1200)
    parser.add_argument("--min-out", type=int, default=16)
    parser.add_argument("--max-out", type=int, default=256)
    parser.add_argument("--systems", type=int, default=8, help="distinct system prompts")
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--shared", type=float, default=0.7, help="share of prompts that start with one")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eligible", type=float, default=block_pool.CONTIGUOUS_ELIGIBLE,
                        help="share of the free blocks contiguous placement may take (block_pool.CONTIGUOUS_ELIGIBLE)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    parser.add_argument("--alloc-cost", action="store_true", help="only the cost of allocations, per placement")
    args = parser.parse_args()
    block_pool.CONTIGUOUS_ELIGIBLE = args.eligible
    if args.alloc_cost:
        alloc_cost()
        return
    torch.set_num_threads(args.threads)
    loaded = load_model(model_dir(args.model, args.size))
    results = [run(loaded, p, args) for p in args.placements.split(",")]
    if args.json:
        print(json.dumps({"results": results}))
        return
    keys = [k for k in results[0] if k != "placement"]
    print("| | " + " | ".join(r["placement"] for r in results) + " |")
    print("|---" * (len(results) + 1) + "|")
    for k in keys:
        print(f"| {k} | " + " | ".join(str(r[k]) for r in results) + " |")


if __name__ == "__main__":
    main()
