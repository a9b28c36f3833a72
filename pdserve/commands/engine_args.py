"""Flags shared by the commands that build an engine in-process (``run``; the workers have their own config)."""

from __future__ import annotations

import argparse

from common.engine.quantization import QUANTIZATION_METHODS


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", required=True, help="local Hugging Face model directory")
    g.add_argument("--dtype", default="auto", help="float32 | bfloat16 | float16 | auto (the checkpoint's)")
    g.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    g.add_argument("--quantization", choices=QUANTIZATION_METHODS, default="none",
                   help="int8 quantization of the linear layers, through torchao (pip install 'pdserve[quant]'): "
                        "int8-weight-only, or int8-dynamic (activations too, per token: W8A8); default none")
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
    g.add_argument("--cuda-graphs", action="store_true",
                   help="CUDA: replay decode steps from CUDA graphs, one per batch and context bucket (default off)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the model over N processes of this host by transformers' tensor-parallel plan "
                        "(gloo on cpu, one GPU each on cuda); N must divide the attention and KV heads")


def engine_from_args(args: argparse.Namespace):
    """Load the model and build an :class:`~common.engine.engine.LLMEngine` (imports torch)."""
    from common.engine.config import EngineConfig
    from common.engine.engine import LLMEngine
    from common.engine.loader import load_model

    load_kwargs = dict(dtype=args.dtype, allow_pickle=args.allow_pickle_weights, quantization=args.quantization)
    config = EngineConfig.from_settings(args)
    tp_size = getattr(args, "tensor_parallel_size", 1)
    if tp_size != 1:  # ranks 1..N-1 are spawned here; engine.close() stops them
        from common.engine.tp_launcher import launch_engine

        return launch_engine(args.model, config, tensor_parallel_size=tp_size, device=args.device, **load_kwargs)
    return LLMEngine(load_model(args.model, device=args.device, **load_kwargs), config)
