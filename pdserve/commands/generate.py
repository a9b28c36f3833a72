"""``pdserve generate "prompt"``: one generation through a running cluster's router, streamed.

Text is printed as it arrives. With ``--json``, stdout carries only one compact JSON object at the end:
``{"request_id", "token_ids", "text", "finish_reason", "prefill_worker_id", "decode_worker_id",
"prompt_tokens", "completion_tokens"}``. Errors: one line on stderr with the gRPC status; exit 2 for
INVALID_ARGUMENT, 1 otherwise (``UNAUTHENTICATED: missing credentials`` when the router wants a key and
neither ``--api-key`` nor ``$PDSERVE_API_KEY`` gives one). Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pdserve.commands.run import add_sampling_args

DEFAULT_ROUTER = "127.0.0.1:50051"
API_KEY_ENV = "PDSERVE_API_KEY"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate through a running cluster's router")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--router", default=None, help=f"router address (default: $PDSERVE_ROUTER, else {DEFAULT_ROUTER})")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds (propagated to every stage)")
    p.add_argument("--json", action="store_true", help="one compact JSON object on stdout at the end")
    p.add_argument("--session-id", default="", help="conversation id: later turns reuse this one's KV")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"API key (or JWT) sent as 'authorization: Bearer KEY' (default: ${API_KEY_ENV})")
    add_sampling_args(p)
    p.set_defaults(func=generate)


def generate(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.client import Client, Result

    address = args.router or os.environ.get("PDSERVE_ROUTER") or DEFAULT_ROUTER
    sampling = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, logprobs=args.logprobs,
        stop=args.stop or (), ignore_eos=args.ignore_eos,
    )  # fmt: skip
    result = Result()
    try:
        with Client(address, api_key=args.api_key or os.environ.get(API_KEY_ENV)) as client:
            for piece in client.stream(args.prompt, timeout_s=args.timeout, session_id=args.session_id, **sampling):
                result.add(piece)
                if not args.json and piece.text:
                    sys.stdout.write(piece.text)
                    sys.stdout.flush()
    except grpc.RpcError as exc:
        print(f"pdserve generate: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    if args.json:
        sys.stdout.write(json.dumps(result.__dict__, ensure_ascii=False, separators=(",", ":")) + "\n")
    else:
        sys.stdout.write("\n")
    return 0
