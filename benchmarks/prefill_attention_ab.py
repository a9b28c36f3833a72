"""Prefill with the engine's bf16 attention kernels against torch's SDPA, two engines on one model in one process
(``EngineConfig.prefill_attention`` ``kernel`` vs ``sdpa``), measurements alternating, medians compared:

- ``fresh``: one prompt of ``--fresh-len`` tokens in one step (whole prompts: ``torch.ops.pdserve.prefill_attention``
  against one causal SDPA per prompt);
- ``chunked``: one prompt of ``--long-len`` tokens prefilled in chunks of ``--chunk`` (the chunks after the first
  continue their sequence: ``paged_prefill_attention`` reading the cache, against the keys gathered and one masked
  SDPA); the time to its first token;
- ``prefixes``: 8 prompts, each a cached prefix of 256-1,024 tokens and 64-192 new ones (a session's next turn).

Prefix caching is off except for ``prefixes`` (whose prefixes are prefilled once, untimed). Needs a CPU whose
kernels build for ``--dtype`` (``prefill_attention_supported``: bf16 with AVX512-BF16, fp32 with AVX-512).

  python benchmarks/prefill_attention_ab.py [--size 350m|60m] [--dtype bfloat16|float32] [--rounds 3]
                                            [--workloads fresh,chunked,prefixes]
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

FIRST = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)


def timed(engine: LLMEngine, prompts: list[list[int]]) -> tuple[float, list[int]]:
    t = time.perf_counter()
    out = engine.generate(prompts, [FIRST] * len(prompts))
    return time.perf_counter() - t, [r.token_ids[0] for r in out]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--size", default="350m", choices=("60m", "350m"))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fresh-len", type=int, default=2048)
    ap.add_argument("--long-len", type=int, default=4000)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--workloads", default="fresh,chunked,prefixes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = model_dir(args.model, args.size)
    from common.engine import cpu_kernels

    dtype = getattr(torch, args.dtype)
    if not (cpu_kernels.load() and torch.ops.pdserve.prefill_attention_supported(dtype)):
        raise SystemExit(f"no {args.dtype} prefill attention kernel on this CPU")
    g = torch.Generator().manual_seed(0)
    vocab = load_model(path, dtype=args.dtype).model.config.vocab_size

    def tokens(n: int) -> list[int]:
        return torch.randint(10, vocab - 1, (n,), generator=g).tolist()

    workloads = args.workloads.split(",")
    for name in workloads:
        caching = name == "prefixes"
        budget = args.chunk if name == "chunked" else max(args.fresh_len, 4096)
        engines = {how: LLMEngine(load_model(path, dtype=args.dtype),
                                  EngineConfig(prefill_attention=how, max_model_len=4096, prefix_caching=caching,
                                               max_num_batched_tokens=budget))
                   for how in ("kernel", "sdpa")}  # fmt: skip
        assert engines["kernel"].runner.prefill_kernel and not engines["sdpa"].runner.prefill_kernel
        for engine in engines.values():  # warm-up, and the kernels' first-call checks
            engine.generate([tokens(300)], [FIRST])
            engine.generate([tokens(args.chunk + 100)] if name == "chunked" else [tokens(64)], [FIRST])
        times: dict[str, list[float]] = {"kernel": [], "sdpa": []}
        agree = 0
        for _ in range(args.rounds):
            if name == "fresh":
                prompts = [tokens(args.fresh_len)]
            elif name == "chunked":
                prompts = [tokens(args.long_len)]
            else:
                prefixes = [tokens(256 * (1 + i % 4)) for i in range(8)]
                prompts = [p + tokens(64 * (1 + i % 3)) for i, p in enumerate(prefixes)]
                for engine in engines.values():
                    engine.generate(prefixes, [FIRST] * len(prefixes))  # cached, untimed
            firsts = {}
            for how, engine in engines.items():
                seconds, firsts[how] = timed(engine, prompts)
                times[how].append(seconds)
            agree += firsts["kernel"] == firsts["sdpa"]
        k, s = statistics.median(times["kernel"]), statistics.median(times["sdpa"])
        new = {"fresh": args.fresh_len, "chunked": args.long_len, "prefixes": sum(64 * (1 + i % 3) for i in range(8))}
        print(f"{name:9s} kernel {k * 1e3:8.1f} ms  sdpa {s * 1e3:8.1f} ms  {s / k:5.2f}x  "
              f"({new[name] / k:6.1f} vs {new[name] / s:6.1f} new tok/s; rounds kernel "
              f"{', '.join(f'{t * 1e3:.0f}' for t in times['kernel'])} / sdpa "
              f"{', '.join(f'{t * 1e3:.0f}' for t in times['sdpa'])} ms; first tokens equal in {agree}/{args.rounds})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
