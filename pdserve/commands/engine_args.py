"""Flags shared by every command that builds an engine (``run`` now; the workers later)."""

from __future__ import annotations

import argparse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", required=True, help="local Hugging Face model directory")
    g.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (the checkpoint's)")
    g.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    g.add_argument("--allow-pickle-weights", action="store_true",
                   help="load a model directory that has only pickle weights (*.bin): UNSAFE, unpickling a file "
                        "can run code at load; use only for checkpoints you trust, prefer converting to safetensors")
    g.add_argument("--kv-cache-memory", type=float, default=None,
                   help="KV cache budget: bytes when > 1, a fraction of free device memory when <= 1")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most requests in the running batch")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--prefill-chunk-size", type=int, default=None,
                   help="most prompt tokens of one request per step (default: the step budget)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def engine_from_args(args: argparse.Namespace):
    """Load the model and build an :class:`~common.engine.engine.LLMEngine` (imports torch)."""
    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.engine.loader import load_model

    loaded = load_model(args.model, dtype=args.dtype, device=args.device,
                        allow_pickle=args.allow_pickle_weights)
    return LLMEngine(loaded, EngineConfig.from_settings(args))
