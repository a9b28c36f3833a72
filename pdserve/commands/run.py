"""``pdserve run``: submit prompts to one in-process engine (batched together) and print the results.

With ``--json`` stdout carries only compact JSON, one object per prompt per line, in input order:
``{"prompt", "prompt_token_ids", "token_ids", "text", "finish_reason"}``. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.commands.engine_args import add_engine_args, engine_from_args


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("run", help="generate from prompts with one in-process engine")
    add_engine_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (text)")
    src.add_argument("--prompts-file", help='JSONL: {"prompt": TEXT} or {"prompt_ids": [...]}, optional "max_tokens"')
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="one compact JSON object per prompt on stdout")
    p.set_defaults(func=run)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults: the model's generation_config, else greedy)")
    g.add_argument("--max-tokens", type=int, default=None, help="new tokens per prompt (default 64)")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed (reproducible)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable; not emitted)")
    g.add_argument("--logprobs", type=int, default=None, help="top-n logprobs per token")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


DEFAULT_MAX_TOKENS = 64


def read_prompts(args: argparse.Namespace) -> list[dict]:
    """The prompts as dicts with ``prompt`` (str) or ``prompt_ids`` (list[int]) and optional ``max_tokens``."""
    if args.prompt is not None:
        return [{"prompt": args.prompt}]
    items = []
    with open(args.prompts_file, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{args.prompts_file}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(item, dict) or ("prompt" in item) == ("prompt_ids" in item):
                raise ValueError(f"{args.prompts_file}:{lineno}: needs exactly one of 'prompt' or 'prompt_ids'")
            if "prompt" in item and not isinstance(item["prompt"], str):
                raise ValueError(f"{args.prompts_file}:{lineno}: 'prompt' must be a string")
            ids = item.get("prompt_ids")
            if ids is not None and not (isinstance(ids, list) and all(type(t) is int for t in ids)):
                raise ValueError(f"{args.prompts_file}:{lineno}: 'prompt_ids' must be a list of integers")
            mt = item.get("max_tokens")
            if mt is not None and type(mt) is not int:
                raise ValueError(f"{args.prompts_file}:{lineno}: 'max_tokens' must be an integer, got {mt!r}")
            items.append(item)
    if not items:
        raise ValueError(f"{args.prompts_file}: no prompts")
    return items


def sampling_from_args(args: argparse.Namespace, generation_config, max_tokens: int | None = None):
    from common.engine.sampling_params import SamplingParams

    gc_max = getattr(generation_config, "max_new_tokens", None) if generation_config is not None else None
    max_new_tokens = next(
        (n for n in (max_tokens, args.max_tokens, gc_max) if n is not None), DEFAULT_MAX_TOKENS
    )
    return SamplingParams.from_generation_config(
        generation_config,
        max_new_tokens=max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=tuple(args.stop) if args.stop else None,
        logprobs=args.logprobs,
        ignore_eos=True if args.ignore_eos else None,
    )


def run(args: argparse.Namespace) -> int:
    items = read_prompts(args)
    for item in items:  # fail on bad sampling values before the model loads
        sampling_from_args(args, None, item.get("max_tokens")).validate()
    engine = engine_from_args(args)
    try:
        gc = engine.loaded.generation_config
        prompts = [it["prompt"] if "prompt" in it else it["prompt_ids"] for it in items]
        params = [sampling_from_args(args, gc, it.get("max_tokens")) for it in items]
        results = engine.generate(prompts, params)
    finally:
        engine.close()  # with --tensor-parallel-size: stops the follower processes
    for item, res in zip(items, results):
        prompt_text = item.get("prompt")
        if prompt_text is None:
            prompt_text = engine.tokenizer.decode(res.prompt_token_ids)
        if args.json:
            obj = {
                "prompt": prompt_text,
                "prompt_token_ids": res.prompt_token_ids,
                "token_ids": res.token_ids,
                "text": res.text,
                "finish_reason": res.finish_reason.value,
            }
            if res.logprobs is not None:
                obj["logprobs"] = [
                    None if lp is None else {"token_id": lp.token_id, "logprob": lp.logprob,
                                             "top": [[t, x] for t, x in zip(lp.top_token_ids, lp.top_logprobs)]}
                    for lp in res.logprobs
                ]
            sys.stdout.write(json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n")
        else:
            if len(items) > 1:
                sys.stdout.write(f"--- prompt: {prompt_text!r} ({res.finish_reason.value})\n")
            sys.stdout.write(res.text + "\n")
    sys.stdout.flush()
    return 0
