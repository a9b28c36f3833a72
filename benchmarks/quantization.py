"""int8 quantization (``--quantization int8-weight-only``, or ``int8-dynamic``: W8A8) against full precision, in
one run.

On the ~60M Llama (hidden 512, 8 layers, fp32; --size 350m: the ~0.35B one), each variant (the model in --dtype;
the same with its linear layers int8) is measured in a fresh process of its own, so its RSS is its own:
  weight MiB: parameters and buffers after loading (a quantized weight: its int8 data, scales and zero points);
  RSS MiB before loading (torch, transformers imported), once the engine is built (weights, fp32 layers'
      packed copies, a KV pool of a fixed size: the same for both), and the process's peak at the end;
  prefill tok/s: one 512-token prompt to its first token (median of 3 different prompts, prefix caching off);
  decode tok/s with 1 and 16 streams: 128-token prompts, --decode-tokens new tokens each, the tokens after each
      request's first over the time after every request had its first.
With --rounds N the variants' processes alternate N times and each figure is the best of its N (the machine may
be shared).
Then greedy top-1 agreement, teacher-forced: the full-precision engine generates --agree-tokens greedy tokens
after each of --agree-prompts random prompts; both models (stock attention) score those sequences, and a
position agrees when the int8 model's argmax is the full-precision model's, so one divergence does not cascade.
Random weights make that rate a floor (near-ties everywhere); --size trained measures it on a small Llama trained
on its tokenizer's corpus (benchmarks/train_tiny.py), with prompts cut from text it was not trained on.

  python benchmarks/quantization.py [--model DIR | --size 60m|350m|trained] [--dtype float32|bfloat16] [--threads 2]
      [--quantization int8-weight-only|int8-dynamic] [--decode-tokens 64] [--agree-prompts 8]
      [--agree-tokens 64] [--rounds 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
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
from common.engine.quantization import QUANTIZATION_METHODS, weight_bytes  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402

PREFILL_LEN = 512
DECODE_PROMPT_LEN = 128
MIB = 2**20


def rss_bytes() -> tuple[int, int]:
    """(current, peak) resident set size of this process, from /proc/self/status."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (length,), generator=g).tolist() for _ in range(n)]


def greedy(max_new_tokens: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)


def decode_tok_s(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Tokens after each request's first over the time after every request had its first."""
    for p in prompts:
        engine.add_request(p, greedy(new_tokens))
    produced: dict[str, int] = {}
    t_all_first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            produced[out.request_id] = produced.get(out.request_id, 0) + len(out.new_token_ids)
        if t_all_first is None and len(produced) == len(prompts):
            t_all_first = time.perf_counter()
    elapsed = time.perf_counter() - t_all_first
    return (sum(produced.values()) - len(prompts)) / elapsed


def measure(args: argparse.Namespace, quantization: str) -> dict:
    """One variant's figures (run in a process of its own)."""
    import transformers  # noqa: F401 - part of the baseline, as in a worker

    rss_start, _ = rss_bytes()
    loaded = load_model(args.model, dtype=args.dtype, quantization=quantization)
    weights = weight_bytes(loaded.model)
    blocks = 16 * -(-(DECODE_PROMPT_LEN + args.decode_tokens) // 16) + PREFILL_LEN // 16 + 8  # 16 streams, bs 16
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=blocks, max_model_len=1024, num_threads=args.threads,
                                            prefix_caching=False))
    rss_built, _ = rss_bytes()
    vocab = engine.vocab_size
    engine.generate(random_prompts(2, 64, vocab, seed=99), greedy(4))  # warm-up: first calls allocate
    prefill_s = []
    for seed in range(3):
        t0 = time.perf_counter()
        engine.generate(random_prompts(1, PREFILL_LEN, vocab, seed=seed), greedy(1))
        prefill_s.append(time.perf_counter() - t0)
    row = {
        "quantization": quantization,
        "weight_bytes": weights,
        "rss_start_bytes": rss_start,
        "rss_built_bytes": rss_built,
        "prefill_tok_s": PREFILL_LEN / statistics.median(prefill_s),
    }
    for streams in (1, 16):
        prompts = random_prompts(streams, DECODE_PROMPT_LEN, vocab, seed=10 + streams)
        row[f"decode_{streams}_tok_s"] = decode_tok_s(engine, prompts, args.decode_tokens)
    row["rss_peak_bytes"] = rss_bytes()[1]
    return row


def best(runs: list[dict]) -> dict:
    """Per figure, the best of several runs of one variant: the most tokens/s, the least bytes."""
    return {k: (max if k.endswith("tok_s") else min)(r[k] for r in runs) if k != "quantization" else runs[0][k]
            for k in runs[0]}


def agreement(args: argparse.Namespace) -> dict:
    """Teacher-forced greedy top-1 agreement of the int8 model with the full-precision one (module docstring)."""
    full = load_model(args.model, dtype=args.dtype)
    blocks = args.agree_prompts * -(-(64 + args.agree_tokens) // 16) + 64
    engine = LLMEngine(full, EngineConfig(num_kv_blocks=blocks, max_model_len=1024, num_threads=args.threads))
    if args.size == "trained":
        from train_tiny import held_out_prompts

        prompts = held_out_prompts(engine.tokenizer, args.agree_prompts, 64)
    else:
        prompts = random_prompts(args.agree_prompts, 64, engine.vocab_size, seed=20)
    outs = engine.generate(prompts, greedy(args.agree_tokens))
    models = [load_model(args.model, dtype=args.dtype, quantization=q).model  # stock attention
              for q in ("none", args.quantization)]
    n = args.agree_tokens
    agree = self_agree = 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt + out.token_ids])
            ref, got = (m(ids).logits[0, -n - 1 : -1].argmax(-1) for m in models)
            agree += int((ref == got).sum())
            self_agree += int((ref == ids[0, -n:]).sum())
    total = len(prompts) * n
    return {"positions": total, "agreement": agree / total, "full_reproduces_engine": self_agree / total}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model dir (default: build/llama-SIZE, built if missing)")
    ap.add_argument("--size", default="60m", choices=("60m", "350m", "trained"),
                    help="preset of the default model (trained: agreement on held-out text)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16: the full-precision variant's dtype")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="int8-weight-only", choices=QUANTIZATION_METHODS[1:],
                    help="the int8 variant measured against full precision")
    ap.add_argument("--decode-tokens", type=int, default=64, help="new tokens per decode stream")
    ap.add_argument("--agree-prompts", type=int, default=8)
    ap.add_argument("--agree-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="alternate the variants' processes this often, keep the best")
    ap.add_argument("--variant", choices=QUANTIZATION_METHODS, default=None,
                    help="measure this variant only and print its JSON (what the run does in each subprocess)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.model = model_dir(args.model, args.size)
    if args.variant is not None:
        print(json.dumps(measure(args, args.variant)))
        return 0
    forwarded = ["--model", args.model, "--dtype", args.dtype, "--threads", str(args.threads),
                 "--decode-tokens", str(args.decode_tokens)]
    variants = ("none", args.quantization)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            proc = subprocess.run([sys.executable, __file__, *forwarded, "--variant", variant], check=True,
                                  stdout=subprocess.PIPE, text=True)
            runs[variant].append(json.loads(proc.stdout.splitlines()[-1]))
    rows = [best(runs[v]) for v in variants]
    agree = agreement(args)
    full, quant = rows
    ratios = {k: quant[k] / full[k] for k in full if k != "quantization"}
    if args.json:
        print(json.dumps({"machine": platform.machine(), "threads": args.threads, "torch": torch.__version__,
                          "model": args.model, "dtype": args.dtype, "quantization": args.quantization, "rows": rows,
                          "int8_over_full": ratios,
                          **agree}))
        return 0
    print(f"{args.model}, {args.dtype}, int8: {args.quantization}, {args.threads} threads, torch {torch.__version__}")
    print(f"{'':26s} {'full':>9s} {'int8':>9s} {'int8/full':>9s}")
    figures = (("weight_bytes", "weight MiB", MIB), ("rss_start_bytes", "RSS before loading MiB", MIB),
               ("rss_built_bytes", "RSS, engine built MiB", MIB), ("rss_peak_bytes", "peak RSS MiB", MIB),
               ("prefill_tok_s", f"prefill tok/s ({PREFILL_LEN})", 1), ("decode_1_tok_s", "decode tok/s, 1 stream", 1),
               ("decode_16_tok_s", "decode tok/s, 16 streams", 1))
    for key, label, scale in figures:
        print(f"{label:26s} {full[key] / scale:9.1f} {quant[key] / scale:9.1f} {ratios[key]:9.2f}")
    print(f"greedy top-1 agreement, teacher-forced ({args.agree_prompts} x {args.agree_tokens}): "
          f"{agree['agreement']:.1%} (full precision reproduces its engine's tokens: "
          f"{agree['full_reproduces_engine']:.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
