"""``pdserve model``: model-directory tools.

``pdserve model build-tiny --arch ARCH --out DIR`` writes a deterministic random-weight checkpoint (see
``common.models.tiny``) and prints DIR on stdout. torch and transformers are imported only when it runs.
"""

from __future__ import annotations

import argparse

ARCH_CHOICES = ("llama", "qwen2", "qwen3", "mistral")  # common.models.tiny.ARCHS, kept here to avoid importing it
SIZE_CHOICES = ("tiny", "60m", "350m")  # common.models.tiny.SIZES
DTYPE_CHOICES = ("float32", "bfloat16", "float16")

# Flag destination -> transformers config kwarg, for the dimension overrides of build-tiny.
_CONFIG_OVERRIDES = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "sliding_window": "sliding_window",
}


def add_parser(subparsers) -> None:
    """Register ``model`` and its subcommands on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    p = subparsers.add_parser("model", help="model-directory tools")
    sub = p.add_subparsers(dest="model_command", required=True, metavar="MODEL_COMMAND")

    b = sub.add_parser("build-tiny", help="write a deterministic random-weight Llama/Qwen2/Qwen3/Mistral checkpoint")
    b.add_argument("--arch", required=True, choices=ARCH_CHOICES)
    b.add_argument("--out", required=True, help="output directory (created; earlier build files replaced)")
    b.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    b.add_argument("--size", choices=SIZE_CHOICES, default="tiny", help="size preset (default tiny)")
    b.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="saved dtype (default: the preset's)")
    g = b.add_argument_group("config overrides (default: the size preset's)")
    g.add_argument("--hidden-size", type=_positive_int)
    g.add_argument("--num-layers", type=_positive_int)
    g.add_argument("--num-heads", type=_positive_int)
    g.add_argument("--num-kv-heads", type=_positive_int)
    g.add_argument("--intermediate-size", type=_positive_int)
    g.add_argument("--vocab-size", type=_positive_int, help="embedding rows; the tokenizer is trained up to it")
    g.add_argument("--max-position-embeddings", type=_positive_int)
    g.add_argument("--sliding-window", type=_positive_int, help="mistral, qwen2 (turns it on for every layer)")
    b.set_defaults(func=build_tiny_command)


def build_tiny_command(args: argparse.Namespace) -> int:
    """Build the checkpoint described by ``args`` and print its directory; return 0."""
    from common.models.tiny import build_tiny

    overrides = {key: getattr(args, dest) for dest, key in _CONFIG_OVERRIDES.items()
                 if getattr(args, dest) is not None}
    out = build_tiny(args.arch, args.out, seed=args.seed, size=args.size, dtype=args.dtype, overrides=overrides)
    print(out)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
