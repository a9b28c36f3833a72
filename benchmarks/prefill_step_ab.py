"""One prefill step of several prompts, two ways in one process: each sequence attending by itself (the engine's
paths since 2026-12-04: whole prompts by one causal SDPA each on their own K/V; with ``--prefixes``, chunks after
cached prefixes by one masked SDPA each over their own keys) against the older path (the group gathered, padded to
its longest chunk and context, one masked SDPA). The same scheduled prompts are prepared for every measurement; the
old path is the same batch with the group's ``fresh_prompt`` / ``seq_spans`` cleared. Pairs alternate, the medians
are compared; the largest logit difference between the two paths is printed.

  python benchmarks/prefill_step_ab.py [--size 60m|350m] [--dtype float32|bfloat16] [--lens 50,100,...]
                                       [--prefixes 64,128,...] [--pairs 5]
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
    if group.fresh_prompt != len(prompts) and group.seq_spans is None:
        raise SystemExit("the step is neither whole prompts nor chunks worth attending one by one")
    if not per_prompt:
        group.fresh_prompt, group.seq_spans = 0, None
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
    ap.add_argument("--prefixes", default="", help="cached prefix lengths, one per prompt (default: none)")
    ap.add_argument("--pairs", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lens = [int(n) for n in args.lens.split(",")]
    loaded = load_model(model_dir(args.model, args.size), dtype=args.dtype)
    prefix_lens = [int(n) for n in args.prefixes.split(",")] if args.prefixes else []
    if prefix_lens and len(prefix_lens) != len(lens):
        raise SystemExit("--prefixes needs one length per prompt")
    engine = LLMEngine(loaded, EngineConfig(prefix_caching=bool(prefix_lens), num_threads=args.threads,
                                            max_num_batched_tokens=max(2048, sum(lens))))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    vocab = min(len(engine.tokenizer), engine.vocab_size)
    prefixes = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in prefix_lens] or [[] for _ in lens]
    if prefix_lens:  # computed once: cached from here on
        engine.generate(prefixes, SamplingParams(max_new_tokens=1, temperature=0.0))
    prompts = [p + torch.randint(4, vocab, (n,), generator=g).tolist() for p, n in zip(prefixes, lens)]
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
    cached = f" after cached prefixes {prefix_lens}" if prefix_lens else ""
    print(f"{args.size} {args.dtype}, new tokens {lens}{cached}: one by one {new * 1e3:,.1f} ms, padded "
          f"{old * 1e3:,.1f} ms, ratio {old / new:.3f}x (medians of {args.pairs}); max |logit difference| {diff:.2e}")


if __name__ == "__main__":
    main()
