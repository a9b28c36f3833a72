"""Decode speed of the engine across model families, each against a Llama of the same shape, in one run.

Every family is a random-weight checkpoint of its own transformers classes at the shape of the 60M benchmark Llama
(hidden 512, 8 layers, 8 heads of 64 over 4 KV heads, vocabulary 32,000; the tokenizer of build/llama-60m), built
once under build/families/. MoE families hold the same active MLP width per token as the Llama's 1,408: Qwen3-MoE
32 experts of 352, top 4 (Qwen3-30B-A3B's proportions); Mixtral 8 of 704, top 2. For each: which of the engine's
fused modules its layers run, and decode tokens/s of 1 stream (128 new tokens) and 16 streams (64 each) after
64-token prompts, the median of --rounds, the time after every stream has its first token; with --prefill N also
prefill tokens/s of one N-token prompt (one step; the median of --rounds, each round a prompt of its own). Families
are measured in turn, the Llama first and last (its two figures show the drift of the machine over the run).
--prefill-attention sets the engine's prompt attention (auto: its kernels where they serve; sdpa: SDPA, or the
plain tensor ops of attention_math.py for Gemma 2's soft cap and GPT-OSS's sinks).

  python benchmarks/families.py [--families llama,qwen3_moe,mixtral,gemma,phi3] [--dtype float32|bfloat16]
      [--rounds 3] [--prefill TOKENS] [--prefill-attention auto|kernel|sdpa] [--json]
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import transformers  # noqa: E402
from bench_models import BUILD, model_dir  # noqa: E402

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import LLMEngine  # noqa: E402
from common.engine.loader import load_model  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
             pad_token_id=3)  # fmt: skip
# name: (config class, causal-LM class, overrides of SHAPE)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=352, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=704)),
    # Qwen3-MoE's proportions; q/k norms over all the heads at once
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=32, num_experts_per_tok=4, intermediate_size=352)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(hidden_act="gelu_pytorch_tanh")),
    # GPT-OSS's experts (interleaved gate and up, biases, a clamped gate) at Qwen3-MoE's proportions; sink logits
    # (plain-op attention, attention_math.py), windows of 128 on alternate layers
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_local_experts=32, num_experts_per_tok=4, intermediate_size=352)),
    # a soft cap of 50 on the attention logits (plain-op attention, attention_math.py), windows of 4,096 on
    # alternate layers
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=64)),
    # per-head Gemma-style q/k norms, windows of 512 on five layers of six
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=64)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    # q/k norms over all the heads at once, a norm after the attention and the MLP (none before)
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    # GLM-4.5's layout: a dense first layer, then 3 routed experts of 352 of 32 beside one shared expert of 352 (the
    # Llama's active width), sigmoid routing with a correction bias, half of each head rotated
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(n_routed_experts=32, num_experts_per_tok=3, moe_intermediate_size=352, n_shared_experts=1,
                      first_k_dense_replace=1, n_group=1, topk_group=1)),  # fmt: skip
}
FUSED = ("RopeAttention", "FusedGatedMLP", "FusedRMSNorm", "FusedScaledRMSNorm", "PackedExperts", "PackedRouter")


def build(name: str) -> Path:
    """The family's checkpoint under build/families/NAME, built once (weights ~N(0, 0.066), as build-tiny's)."""
    out = BUILD / "families" / name
    if (out / "model.safetensors").exists():
        return out
    config_cls, model_cls, overrides = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**SHAPE, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.066)
    model.save_pretrained(out)
    tokenizer = Path(model_dir("", "60m"))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(tokenizer / f, out / f)
    return out


def decode_rate(engine: LLMEngine, streams: int, new: int) -> float:
    """Decode tokens/s of ``streams`` greedy requests after 64-token prompts, from when all have a first token."""
    params = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
    for i in range(streams):
        engine.add_request([5 + (7 * i + j) % 300 for j in range(64)], params)
    started: set[str] = set()
    while len(started) < streams:
        started |= {out.request_id for out in engine.step() if out.new_token_ids}
    t0, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return tokens / (time.perf_counter() - t0)


def prefill_rate(engine: LLMEngine, tokens: int, seed: int) -> float:
    """Prefill tokens/s of one ``tokens``-token prompt (its own tokens: no cached prefix), one step."""
    engine.add_request([5 + (7 * j + 131 * seed) % 31000 for j in range(tokens)],
                       SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))  # fmt: skip
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return tokens / (time.perf_counter() - t0)


def measure(name: str, dtype: str, rounds: int, prefill: int = 0, prefill_attention: str = "auto") -> dict:
    config = EngineConfig(max_num_seqs=64, max_model_len=max(1024, prefill + 64),
                          max_num_batched_tokens=max(2048, prefill), prefill_attention=prefill_attention)
    engine = LLMEngine(load_model(str(build(name)), dtype=dtype), config)
    kinds = collections.Counter(type(m).__name__ for m in engine.loaded.model.modules())
    decode_rate(engine, 1, 8)  # warm-up
    one = statistics.median(decode_rate(engine, 1, 128) for _ in range(rounds))
    sixteen = statistics.median(decode_rate(engine, 16, 64) for _ in range(rounds))
    row = {"family": name, "fused": {k: kinds[k] for k in FUSED if kinds[k]}, "flat_forward":
           engine.runner.flat is not None, "tok_s_1": round(one, 1), "tok_s_16": round(sixteen, 1)}  # fmt: skip
    if prefill:
        prefill_rate(engine, prefill, seed=rounds)  # warm-up
        row["prefill_kernel"] = engine.runner.prefill_kernel
        row["prefill_tok_s"] = round(statistics.median(prefill_rate(engine, prefill, r) for r in range(rounds)), 1)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="llama,qwen3_moe,mixtral,gemma,phi3",
                    help=f"comma-separated, of {', '.join(FAMILIES)} (llama is always measured first and last)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=0, metavar="TOKENS", help="also prefill tokens/s of such a prompt")
    ap.add_argument("--prefill-attention", default="auto", choices=("auto", "kernel", "sdpa"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    names = [n for n in args.families.split(",") if n and n != "llama"]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        ap.error(f"unknown families: {', '.join(unknown)}")
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)
    rows = [measure(n, args.dtype, args.rounds, args.prefill, args.prefill_attention)
            for n in ["llama", *names, "llama"]]  # fmt: skip
    keys = ["tok_s_1", "tok_s_16", *(["prefill_tok_s"] if args.prefill else [])]
    for key in keys:
        base = statistics.mean(r[key] for r in (rows[0], rows[-1]))
        for r in rows:
            r[key.replace("tok_s", "vs_llama")] = round(r[key] / base, 2)
    if args.json:
        print(json.dumps({"machine": platform.processor() or platform.machine(), "dtype": args.dtype,
                          "threads": args.threads, "prefill": args.prefill,
                          "prefill_attention": args.prefill_attention, "rows": rows}, indent=2))  # fmt: skip
        return 0
    print(f"dtype {args.dtype}, {args.threads} threads; decode tok/s (x the Llama's, mean of its two runs)"
          + (f"; prefill of {args.prefill} tokens, prompt attention {args.prefill_attention}" if args.prefill else ""))
    for r in rows:
        fused = ", ".join(f"{k} {v}" for k, v in r["fused"].items()) or "none"
        prefill = (f"  prefill {r['prefill_tok_s']:7.1f} ({r['prefill_vs_llama']:.2f}x, "
                   f"{'kernel' if r['prefill_kernel'] else 'sdpa'})" if args.prefill else "")  # fmt: skip
        print(f"{r['family']:10s} 1 stream {r['tok_s_1']:7.1f} ({r['vs_llama_1']:.2f}x)  16 streams "
              f"{r['tok_s_16']:7.1f} ({r['vs_llama_16']:.2f}x){prefill}  flat forward "
              f"{'on' if r['flat_forward'] else 'off'}; fused: {fused}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
