"""``pdserve bench``: a load generator against a running cluster's router (gRPC, or HTTP with ``--http``).

    pdserve bench --router 127.0.0.1:50051 --num-requests 200 --request-rate 1,2,4 \\
        --input-len 512 --output-len 128 --slo-ttft-ms 500 --slo-tpot-ms 50 --result-json out.json

Load is either a fixed ``--concurrency`` (that many sessions in flight) or a ``--request-rate`` (Poisson
arrivals by default, ``--arrival fixed`` for even gaps; ``inf`` sends everything at once; no bound on the
requests in flight). What arrives is a session: with ``--turns T`` its later turns follow the previous one as
soon as it ends, so ``--turns 1`` makes the rate a request rate. A comma-separated
list of rates runs one pass per rate, in order; pass ``i`` draws its workload and arrivals with seed
``--seed + i``, so the passes are alike but a later one does not replay the prompts an earlier one left in
the prefix cache. The workload (:mod:`pdserve.bench.workload`) is synthetic token ids; every request asks for
exactly its output length (``max_tokens``, ``ignore_eos``).

stdout: a summary table per pass (and a sweep table after two passes or more). ``--result-json`` writes the
JSON result described in :mod:`pdserve.bench.report`; ``--plot-dir`` writes the PNGs of
:mod:`pdserve.bench.plots`. A progress bar goes to stderr unless ``--no-progress``.

Exit status: 0 when every pass ran, failed requests included (they are reported by status); 2 on usage
errors, found before any request (bad values, a missing directory for ``--result-json``, ``--plot-dir``
without matplotlib installed); 1 when the HTTP front cannot be asked for its model. Heavy imports (grpc,
tqdm) happen inside :func:`bench` only.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import uuid

from pdserve.bench.workload import ARRIVALS

DEFAULT_ROUTER = "127.0.0.1:50051"
API_KEY_ENV = "PDSERVE_API_KEY"
DEFAULT_VOCAB_SIZE = 256  # below every byte-level BPE vocabulary (the tiny test models have about 4096 ids)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="load-test a running cluster's router and report latencies",
                              description="Load-test a running cluster's router: TTFT, TPOT, ITL, E2E, "
                                          "throughput and goodput.")
    target = p.add_argument_group("target")
    target.add_argument("--router", metavar="ADDR", default=None,
                        help=f"router gRPC address (default: $PDSERVE_ROUTER, else {DEFAULT_ROUTER}); "
                             "with --http, HOST:PORT of the HTTP front")
    target.add_argument("--http", action="store_true",
                        help="use the OpenAI-compatible HTTP API (POST /v1/completions, streamed)")
    target.add_argument("--http-url", metavar="URL", default=None, help="base URL of the HTTP front (implies --http; "
                                                         "default http://ROUTER)")
    target.add_argument("--model", metavar="NAME", default=None,
                        help="HTTP 'model' field (default: the first of GET /v1/models)")
    target.add_argument("--api-key", metavar="KEY", default=None,
                        help=f"API key (or JWT) sent as 'authorization: Bearer KEY' over gRPC and HTTP "
                             f"(default: ${API_KEY_ENV})")

    load = p.add_argument_group("load")
    load.add_argument("--num-requests", type=_positive_int, metavar="N", required=True, help="requests per pass")
    offered = load.add_mutually_exclusive_group(required=True)
    offered.add_argument("--concurrency", type=_positive_int, metavar="C", help="sessions in flight at once")
    offered.add_argument("--request-rate", type=_rates, metavar="RATE[,RATE...]",
                         help="session starts per second; a comma-separated list sweeps (one pass per rate); "
                              "inf: all at once")
    load.add_argument("--arrival", choices=ARRIVALS, default="poisson",
                      help="arrival process at a request rate (default poisson)")
    load.add_argument("--turns", type=_positive_int, metavar="T", default=1,
                      help="requests per session; each next prompt = previous prompt + output + new tokens")
    load.add_argument("--no-session-ids", action="store_true",
                      help="do not send a session id with multi-turn sessions (each turn is then routed anew)")
    load.add_argument("--timeout", type=_positive_float, metavar="SECONDS", default=None,
                      help="deadline per request in seconds")

    work = p.add_argument_group("workload")
    work.add_argument("--input-len", type=_positive_int, metavar="L", required=True, help="mean prompt length (tokens)")
    work.add_argument("--output-len", type=_positive_int, metavar="M", required=True,
                      help="mean output length (tokens)")
    work.add_argument("--input-len-range", type=_range_ratio, metavar="R", default=0.0,
                      help="R in [0, 1): prompt lengths uniform in [L(1-R), L(1+R)] (default 0)")
    work.add_argument("--output-len-range", type=_range_ratio, metavar="R", default=0.0,
                      help="R in [0, 1): output lengths uniform in [M(1-R), M(1+R)] (default 0)")
    work.add_argument("--shared-prefix-ratio", type=_fraction, metavar="F", default=0.0,
                      help="fraction of each prompt that is a prefix shared by all requests (default 0)")
    work.add_argument("--vocab-size", type=_positive_int, metavar="V", default=DEFAULT_VOCAB_SIZE,
                      help=f"prompt token ids are drawn from [10, V) (default {DEFAULT_VOCAB_SIZE})")
    work.add_argument("--temperature", type=float, metavar="T", default=0.0, help="sampling temperature (default 0.0)")
    work.add_argument("--seed", type=int, metavar="S", default=0,
                      help="seed of prompts, lengths and arrivals (default 0)")

    out = p.add_argument_group("results")
    out.add_argument("--slo-ttft-ms", type=_positive_float, metavar="MS", default=None, help="TTFT SLO for goodput")
    out.add_argument("--slo-tpot-ms", type=_positive_float, metavar="MS", default=None, help="TPOT SLO for goodput")
    out.add_argument("--result-json", metavar="FILE", default=None, help="write the JSON result here")
    out.add_argument("--plot-dir", metavar="DIR", default=None,
                     help="write PNG plots here (needs matplotlib: pip install 'pdserve[bench]')")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=bench)


def bench(args: argparse.Namespace) -> int:
    from pdserve.bench import plots, report, workload
    from pdserve.bench.runner import run_pass

    if args.plot_dir and not plots.matplotlib_available():
        print(f"pdserve bench: error: --plot-dir: {plots.INSTALL_HINT}", file=sys.stderr)
        return 2
    result_dir = os.path.dirname(os.path.abspath(args.result_json)) if args.result_json else ""
    if result_dir and not os.path.isdir(result_dir):  # found out before the run, not after it
        raise ValueError(f"--result-json: directory {result_dir!r} does not exist")
    spec = workload.WorkloadSpec(
        num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
        input_len_range=args.input_len_range, output_len_range=args.output_len_range,
        shared_prefix_ratio=args.shared_prefix_ratio, turns=args.turns, vocab_size=args.vocab_size,
    )  # fmt: skip
    address = args.router or os.environ.get("PDSERVE_ROUTER") or DEFAULT_ROUTER
    try:
        backend = _backend(args, address)
    except OSError as exc:
        print(f"pdserve bench: error: cannot ask the HTTP front for its model: {exc}", file=sys.stderr)
        return 1
    slo = report.Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    loads = [(rate, None) for rate in args.request_rate] if args.request_rate else [(None, args.concurrency)]
    runs, samples = [], []
    try:
        for i, (rate, concurrency) in enumerate(loads):
            sessions = workload.build_sessions(spec, seed=args.seed + i)
            offsets_s = None
            if rate is not None:
                offsets_s = workload.arrival_times_s(len(sessions), rate, args.arrival, seed=args.seed + i)
            result = run_pass(backend, sessions, vocab_size=spec.vocab_size, temperature=args.temperature,
                              timeout_s=args.timeout, concurrency=concurrency, start_offsets_s=offsets_s,
                              request_rate=rate, progress=not args.no_progress, desc=f"pass {i + 1}/{len(loads)}",
                              session_prefix=None if args.no_session_ids else f"bench-{uuid.uuid4().hex[:12]}")
            summary = report.summarize(result, slo)
            print(report.format_summary(summary, slo), flush=True)
            runs.append(summary)
            samples.append(report.latency_samples_ms(result))
    finally:
        backend.close()
    if len(runs) > 1:
        print(report.format_sweep(runs))
    if args.result_json:
        report.write_json(args.result_json, report.result_json(runs, _settings(args, address, backend)))
        print(f"pdserve bench: result written to {args.result_json}", file=sys.stderr)
    if args.plot_dir:
        for path in plots.write_plots(args.plot_dir, runs, samples):
            print(f"pdserve bench: plot written to {path}", file=sys.stderr)
    return 0


def _backend(args: argparse.Namespace, address: str):
    api_key = args.api_key or os.environ.get(API_KEY_ENV)
    if args.http or args.http_url:
        from pdserve.bench.http_backend import HttpBackend, base_url_from, first_model_id

        base_url = base_url_from(address, args.http_url)
        return HttpBackend(base_url, args.model or first_model_id(base_url, api_key=api_key), api_key=api_key)
    from pdserve.bench.grpc_backend import GrpcBackend

    return GrpcBackend(address, api_key=api_key)


def _settings(args: argparse.Namespace, address: str, backend) -> dict:
    """The ``settings`` object of the JSON result: what was offered, to whom, with which workload."""
    rates = [("inf" if math.isinf(r) else r) for r in args.request_rate] if args.request_rate else None
    return {
        "protocol": backend.name,
        "router": address,
        "http_url": getattr(backend, "base_url", None),
        "model": getattr(backend, "model", None),
        "num_requests": args.num_requests, "concurrency": args.concurrency, "request_rates": rates,
        "arrival": args.arrival, "turns": args.turns, "timeout_s": args.timeout,
        "input_len": args.input_len, "output_len": args.output_len, "input_len_range": args.input_len_range,
        "output_len_range": args.output_len_range, "shared_prefix_ratio": args.shared_prefix_ratio,
        "vocab_size": args.vocab_size, "temperature": args.temperature, "seed": args.seed,
        "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
    }  # fmt: skip


# -- argparse types (a bad value is a usage error: exit 2 with the value named) ------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _rates(text: str) -> list[float]:
    """``"1,2,4"`` → ``[1.0, 2.0, 4.0]``; each > 0 (``inf`` allowed)."""
    return [_positive_float(part.strip()) for part in text.split(",")]


def _range_ratio(text: str) -> float:
    value = _fraction(text)
    if value >= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value
