"""One prefill step of several whole prompts, two ways in one process: each prompt attending to its own K/V (one
causal SDPA per prompt, the engine's path since 2026-12-04) against the older path (the group gathered from the
cache, padded to its longest prompt, one masked SDPA). The same scheduled prompts are prepared for every
measurement; the old path is the same batch with the group's ``fresh_prompt`` cleared. Pairs alternate, the
medians are compared; the largest logit difference between the two paths is printed.

  python benchmarks/prefill_step_ab.py [--size 60m|350m] [--dtype float32|bfloat16] [--lens 50,100,...] [--pairs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_models import model_dir  # noqa: E402

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import LLMEngine  # noqa: E402
from common.engine.loader import load_model  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402


def step(engine: LLMEngine, prompts: list[list[int]], per_prompt: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one prefill step of ``prompts`` (then aborted) and its logits."""
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=2, temperature=0.0)) for p in prompts]
    sched = engine.scheduler.schedule()
    if len(sched.scheduled) != len(prompts):
        raise SystemExit("the prompts do not fit one step: fewer or shorter --lens")
    batch = engine.runner.prepare(sched.scheduled)
    group = batch.attn.groups[-1]
    assert group.fresh_prompt == len(prompts)
    if not per_prompt:
        group.fresh_prompt = 0
    t = time.perf_counter()
    logits = engine.runner.run(batch)
    seconds = time.perf_counter() - t
    for rid in ids:
        engine.abort(rid)
    return seconds, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir (default: build/llama-SIZE, built if missing)")
    ap.add_argument("--size", default="60m", choices=("60m", "350m"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lens", default="50,100,150,200,250,300,350,400", help="prompt lengths, comma-separated")
    ap.add_argument("--pairs", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lens = [int(n) for n in args.lens.split(",")]
    loaded = load_model(model_dir(args.model, args.size), dtype=args.dtype)
    engine = LLMEngine(loaded, EngineConfig(prefix_caching=False, max_num_batched_tokens=max(2048, sum(lens)),
                                            num_threads=args.threads))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    vocab = min(len(engine.tokenizer), engine.vocab_size)
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lens]
    step(engine, prompts, True)  # warm-up (and the flat forward's one check)
    step(engine, prompts, False)
    times: dict[bool, list[float]] = {True: [], False: []}
    logits: dict[bool, torch.Tensor] = {}
    for _ in range(args.pairs):
        for per_prompt in (True, False):
            seconds, logits[per_prompt] = step(engine, prompts, per_prompt)
            times[per_prompt].append(seconds)
    new, old = statistics.median(times[True]), statistics.median(times[False])
    diff = float((logits[True] - logits[False]).abs().max())
    print(f"{args.size} {args.dtype}, prompts {lens}: per-prompt {new * 1e3:,.1f} ms, padded {old * 1e3:,.1f} ms, "
          f"ratio {old / new:.3f}x (medians of {args.pairs}); max |logit difference| {diff:.2e}")


if __name__ == "__main__":
    main()
