"""How close the engine runs to this machine's roofline, measured in one run.

1. The machine: matmul FLOP/s in fp32 and bf16 (square matmuls, best of several; for bf16 also oneDNN's linear
   over a packed weight, whichever is faster) and memory bandwidth
   (a large tensor copy; read + write bytes over time).
2. Prefill: one prompt of --prompt-len tokens through the engine (``max_new_tokens`` 1), as a fraction of
   the FLOP roofline of the model's dtype (for bf16 on a CPU without bf16 arithmetic: the fp32 rate). FLOPs
   of a prompt: 2 x (non-embedding parameters) per token, plus the causal attention products (QK^T and AV:
   2 x 2 x layers x heads x head_dim x (n^2 + n) / 2), plus the LM head once (``logits_to_keep``: only the
   last token's logits are computed). Where the engine's decode layout of the weights is not what a prefill
   worker packs (bf16 on AMX CPUs: ``--weight-layout prefill``), the prefill also runs on an engine packed as a
   prefill worker's. The prefills run in --rounds rounds, each prefill between two probes of the peak (one right
   before it, one right after), and each prefill's fraction is taken against the higher of its two probes: on a
   host whose matmul rate swings with its neighbours' load (a 2-core Xeon VM read 790 and 2,450 bf16 GFLOP/s
   minutes apart, and 925 and 2,200 within one round of seconds) a peak probed once, minutes before the prefill,
   measured the phase more than the engine. A prefill is *steady* where its two probes agree within 15%
   (``STEADY``): the phase did not change under it. Each system's figure is the median of its steady prefills (of
   all of them where none was steady, said so in the output); --json lists every round (``prefill_rounds``) and
   each system's count of steady ones (``..._steady_rounds``).
3. Single-stream decode: one request (--decode-prompt-len prompt tokens, --decode-tokens new tokens), its
   decode steps as a fraction of the bandwidth roofline: each step reads every weight the step uses (all
   parameters but the embedding table, of which it reads one row; the LM head counts even when tied to the
   embeddings) and the KV of its context.
Stock transformers (``generate``, default attention) runs the same prefill and decode for comparison, so the
engine's fractions sit next to HF's from the same run.

  python benchmarks/roofline.py [--model DIR] [--size 60m|350m] [--dtype float32|bfloat16] [--threads 2] [--rounds 5]
                                [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_models import kernel_use, model_dir  # noqa: E402

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import LLMEngine  # noqa: E402
from common.engine.loader import load_model  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402


def best_of(fn, repeats: int) -> float:
    """Shortest wall time of ``repeats`` calls (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    return 2 * n**3 / best_of(lambda: torch.mm(a, b, out=out), repeats)


def packed_linear_flops(rows: int = 2048, k: int = 1024, n: int = 4096, repeats: int = 5) -> float:
    """bf16 FLOP/s of oneDNN's linear over a weight packed for it (``mkldnn._reorder_linear_weight``), as the
    engine's prefill-sized matmuls run; 0 where this torch has no such op."""
    try:
        x, w = torch.randn(rows, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
        return 2 * rows * k * n / best_of(
            lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], ""), repeats)
    except (RuntimeError, AttributeError):
        return 0.0


def bf16_matmul_flops() -> float:
    """bf16 FLOP/s at 2048^3 where the CPU computes bf16 natively (AVX512-BF16, AMX: hundreds of GFLOP/s, and a
    1024^3 product with two repeats under-reads it by half), or of oneDNN's linear over a packed weight where
    that is faster (on a 2-core Xeon whose AMX ran ``torch.mm`` at 800-1,000 GFLOP/s, the engine's prefill went
    past that: the plain layouts under-read the machine); a CPU without (~1 GFLOP/s: torch's scalar fallback,
    where 2048^3 would take minutes) is measured at 1024^3."""
    if matmul_flops(torch.bfloat16, n=256, repeats=1) > 20e9:
        return max(matmul_flops(torch.bfloat16), packed_linear_flops())
    return matmul_flops(torch.bfloat16, n=1024, repeats=2)


def probe_roofline(peak: dict[str, float], dtype: str) -> float:
    """The FLOP roofline of ``dtype`` probed again now: the dtype's own matmul rate (for bf16 never less than the
    fp32 rate in ``peak``, as in :func:`compute_roofline`)."""
    now = dict(peak)
    now[dtype] = bf16_matmul_flops() if dtype == "bfloat16" else matmul_flops(torch.float32)
    return compute_roofline(now, dtype)


STEADY = 0.85  # a prefill is steady where the lower of its two probes is at least this share of the higher


def prefill_rounds(runs: dict, probe, rounds: int, flops: float, tokens: int) -> list[dict]:
    """``rounds`` rounds of every ``runs`` entry (name -> a prefill's seconds), a ``probe()`` of the peak FLOP/s
    before the first and after each prefill: per prefill ``{name}_tok_s``, ``{name}_of_peak`` (against the higher
    of the probes around it), ``{name}_roofline_gflops`` (that probe) and ``{name}_steady`` (the two agree within
    ``STEADY``); ``roofline_gflops``: the round's highest probe."""
    out = []
    last = probe()
    for _ in range(max(1, rounds)):
        one = {}
        for name, run in runs.items():
            t = run()
            now = probe()
            roof = max(last, now)
            one[f"{name}_tok_s"] = tokens / t
            one[f"{name}_of_peak"] = flops / t / roof
            one[f"{name}_roofline_gflops"] = roof / 1e9
            one[f"{name}_steady"] = min(last, now) >= STEADY * roof
            last = now
        one["roofline_gflops"] = max(v for k, v in one.items() if k.endswith("_roofline_gflops"))
        out.append(one)
    return out


def median_prefill(rounds: list[dict], name: str) -> dict:
    """System ``name``'s figures from its median prefill by fraction of the peak, among its steady ones (all of
    them where none was steady): ``{name}_tok_s``, ``{name}_of_peak``, ``{name}_roofline_gflops``,
    ``{name}_steady_rounds`` (how many were steady)."""
    steady = [r for r in rounds if r[f"{name}_steady"]]
    pool = sorted(steady or rounds, key=lambda r: r[f"{name}_of_peak"])
    pick = pool[len(pool) // 2]
    keys = (f"{name}_tok_s", f"{name}_of_peak", f"{name}_roofline_gflops")
    return {**{k: pick[k] for k in keys}, f"{name}_steady_rounds": len(steady)}


def compute_roofline(peak: dict[str, float], dtype: str) -> float:
    """The FLOP/s a prefill in ``dtype`` can reach: the measured matmul rate, but for bf16 never less than fp32's.
    A CPU without bf16 arithmetic (AVX2 only) does bf16 work at best as fp32 FMAs on widened values, which is
    what the engine's AVX2 bf16 kernel does; torch's own bf16 matmul there is a scalar fallback far below it."""
    return max(peak["bfloat16"], peak["float32"]) if dtype == "bfloat16" else peak[dtype]


def copy_bandwidth(num_bytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes moved per second by a large copy: each byte is read once and written once."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_of(lambda: dst.copy_(src), repeats)


class ModelShape:
    def __init__(self, model: torch.nn.Module, config) -> None:
        cfg = config.get_text_config()
        self.layers = int(cfg.num_hidden_layers)
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        embed = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        params = {id(p): p for p in model.parameters()}
        self.total_params = sum(p.numel() for p in params.values())
        self.embed_params = embed.numel()
        self.head_params = head.numel()
        self.tied = head.data_ptr() == embed.data_ptr()
        # non-embedding parameters, each token multiplies through all of them once (LM head apart)
        self.body_params = self.total_params - self.embed_params - (0 if self.tied else self.head_params)
        self.elem = embed.element_size()

    def prefill_flops(self, n: int) -> float:
        attn = 2 * 2 * self.layers * self.heads * self.head_dim * (n * n + n) / 2
        return 2 * self.body_params * n + attn + 2 * self.head_params

    def decode_step_bytes(self, context: int) -> float:
        weights = (self.body_params + self.head_params) * self.elem
        kv = 2 * self.layers * self.kv_heads * self.head_dim * context * self.elem
        return weights + kv


def engine_prefill_s(engine: LLMEngine, prompt: list[int]) -> float:
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    return best_of(lambda: engine.generate([prompt], params), 2)


def engine_decode(engine: LLMEngine, prompt: list[int], new: int) -> tuple[float, list[int]]:
    """Seconds of the ``new - 1`` decode steps after the first token (prefill excluded), and the tokens."""
    engine.add_request(prompt, SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True))
    tokens: list[int] = []
    t_first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
        if t_first is None and tokens:
            t_first = time.perf_counter()
    return time.perf_counter() - t_first, tokens


def hf_prefill_s(model, prompt: list[int]) -> float:
    ids = torch.tensor([prompt])

    def run():
        with torch.inference_mode():
            model(input_ids=ids, logits_to_keep=1)

    return best_of(run, 2)


def hf_decode(model, prompt: list[int], new: int, pad_id: int) -> tuple[float, list[int]]:
    """Seconds of HF generate's ``new - 1`` decode steps (a 1-token generate's time subtracted)."""
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)

    def gen(n):
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=pad_id)
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    t_one = min(gen(1)[0] for _ in range(2))
    t_all, tokens = gen(new)
    return t_all - t_one, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model directory (default: build/llama-SIZE, built if missing)")
    ap.add_argument("--size", default="60m", choices=("60m", "350m"))
    ap.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto (the checkpoint's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=2048, help="prefill prompt tokens")
    ap.add_argument("--decode-prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5, help="prefill rounds, each prefill between two probes of the peak")
    ap.add_argument("--no-hf", action="store_true", help="skip stock transformers' figures")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = model_dir(args.model, args.size)

    peak = {"float32": matmul_flops(torch.float32), "bfloat16": bf16_matmul_flops()}
    bandwidth = copy_bandwidth()
    loaded = load_model(path, dtype=args.dtype)
    dtype = str(loaded.dtype).removeprefix("torch.")
    shape = ModelShape(loaded.model, loaded.config)
    hf = None if args.no_hf else load_model(path, dtype=args.dtype).model
    max_len = max(args.prompt_len + 1, args.decode_prompt_len + args.decode_tokens) + 16
    engine = LLMEngine(loaded, EngineConfig(max_num_seqs=16, max_model_len=max_len,
                                            max_num_batched_tokens=max(2048, args.prompt_len), prefix_caching=False))
    g = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    prompt = torch.randint(4, vocab, (args.prompt_len,), generator=g).tolist()
    dprompt = torch.randint(4, vocab, (args.decode_prompt_len,), generator=g).tolist()
    engine.generate([dprompt[:64]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up

    flops = shape.prefill_flops(args.prompt_len)
    mean_ctx = args.decode_prompt_len + args.decode_tokens / 2
    step_bytes = shape.decode_step_bytes(int(mean_ctx))
    steps = args.decode_tokens - 1
    result = {
        "machine": platform.machine(), "threads": args.threads, "torch": torch.__version__, "model": path,
        "dtype": dtype, "params": shape.total_params, "tied_embeddings": shape.tied,
        "matmul_gflops": {k: v / 1e9 for k, v in peak.items()}, "copy_gb_s": bandwidth / 1e9,
        "prefill_roofline_gflops": compute_roofline(peak, dtype) / 1e9,
        "prefill_tokens": args.prompt_len, "prefill_gflop": flops / 1e9,
        "decode_step_mb": step_bytes / 1e6, "decode_roofline_tok_s": bandwidth / step_bytes,
        "cpu_kernels": kernel_use(engine),
    }
    worker = None
    if any(getattr(m, "layout", "") == "bf16_amx" for m in engine.runner.model.modules()):
        # a prefill worker packs its weights for prefill (--weight-layout auto): here oneDNN's AMX layout
        worker = LLMEngine(load_model(path, dtype=args.dtype), dataclasses.replace(engine.config,
                                                                                  weight_layout="prefill"))
        worker.generate([dprompt[:64]], SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    # result keys of each prefill: the engine's, a prefill worker's, stock transformers'
    runs = {"engine_prefill": lambda: engine_prefill_s(engine, prompt)}
    if worker is not None:
        runs["prefill_worker"] = lambda: engine_prefill_s(worker, prompt)
    if hf is not None:
        runs["hf_prefill"] = lambda: hf_prefill_s(hf, prompt)
    rounds = prefill_rounds(runs, lambda: probe_roofline(peak, dtype), args.rounds, flops, args.prompt_len)
    for name in runs:
        result.update(median_prefill(rounds, name))
    result["prefill_roofline_gflops"] = result["engine_prefill_roofline_gflops"]
    result["prefill_rounds"] = rounds
    runs.clear()
    worker = None  # its memory back before the decode measurement
    t, engine_tokens = engine_decode(engine, dprompt, args.decode_tokens)
    result["engine_decode_tok_s"] = steps / t
    result["engine_decode_of_roofline"] = steps / t / result["decode_roofline_tok_s"]
    if hf is not None:
        pad_id = loaded.tokenizer.pad_token_id or 0
        t, hf_tokens = hf_decode(hf, dprompt, args.decode_tokens, pad_id)
        result["hf_decode_tok_s"] = steps / t
        result["hf_decode_of_roofline"] = steps / t / result["decode_roofline_tok_s"]
        result["engine_equals_hf"] = engine_tokens == hf_tokens
        # bf16 rounds differently along each path (fused, packed matmuls): how many leading tokens still agree
        pairs = list(zip(engine_tokens, hf_tokens))
        result["engine_hf_common_prefix"] = next((i for i, (a, b) in enumerate(pairs) if a != b), len(pairs))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"machine: matmul fp32 {result['matmul_gflops']['float32']:.0f} GFLOP/s, "
          f"bf16 {result['matmul_gflops']['bfloat16']:.0f} GFLOP/s, copy {result['copy_gb_s']:.1f} GB/s "
          f"({args.threads} threads, torch {torch.__version__})")
    print(f"model: {path} ({shape.total_params / 1e6:.0f}M params, {dtype}, tied embeddings {shape.tied}); "
          "engine CPU kernels: " + ", ".join(f"{k} {'on' if v else 'off'}" for k, v in result["cpu_kernels"].items()))
    roof = result["prefill_roofline_gflops"]
    widened = " (the fp32 rate: this CPU has no faster bf16 arithmetic)" if dtype != "float32" and peak[
        "float32"] >= peak[dtype] else ""  # fmt: skip
    print(f"prefill of {args.prompt_len} tokens ({flops / 1e9:.1f} GFLOP): each system's median prefill of "
          f"{len(rounds)} rounds among its steady ones (probes before and after within {1 - STEADY:.0%}), each "
          f"against the peak probed around it (engine's: {roof:.0f} GFLOP/s{widened}):")

    def line(label: str, name: str, note: str = "") -> None:
        steady = result[f"{name}_steady_rounds"]
        print(f"  {label} {result[f'{name}_tok_s']:8.0f} tok/s  {result[f'{name}_of_peak']:6.1%} of "
              f"{result[f'{name}_roofline_gflops']:.0f}  ({steady} of {len(rounds)} steady"
              f"{'; none: the median of all' if not steady else ''}){note}")

    line("engine", "engine_prefill")
    if "prefill_worker_tok_s" in result:
        line("engine", "prefill_worker", "   (a prefill worker's weight layout: --weight-layout prefill)")
    if hf is not None:
        line("HF    ", "hf_prefill")
    print("  engine, each round (of its own peak; * steady): " + ", ".join(
        f"{r['engine_prefill_of_peak']:.1%} of {r['engine_prefill_roofline_gflops']:.0f}"
        f"{'*' if r['engine_prefill_steady'] else ''}" for r in rounds))
    print(f"single-stream decode, context {args.decode_prompt_len}..{args.decode_prompt_len + args.decode_tokens} "
          f"({step_bytes / 1e6:.0f} MB a step; roofline {result['decode_roofline_tok_s']:.0f} tok/s):")
    print(f"  engine {result['engine_decode_tok_s']:8.1f} tok/s  "
          f"{result['engine_decode_of_roofline']:6.1%} of roofline")
    if hf is not None:
        print(f"  HF     {result['hf_decode_tok_s']:8.1f} tok/s  {result['hf_decode_of_roofline']:6.1%} of roofline"
              f"   (engine tokens == HF tokens: {result['engine_equals_hf']}, "
              f"first {result['engine_hf_common_prefix']} of {len(engine_tokens)} equal)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
