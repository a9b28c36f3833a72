"""The results of ``pdserve bench``: one summary object per pass, the JSON result, and the tables for people.

A pass's summary (:func:`summarize`) has these keys (scripts rely on them; later versions may add keys, never
drop them):

- ``completed``, ``failed``: requests; ``errors``: status name → count of failed requests (a gRPC status code
  name such as ``"UNAVAILABLE"``, an HTTP status such as ``"503"``, or an exception name);
- ``input_tokens``, ``output_tokens``: summed over completed requests;
- ``duration_s``: the pass's wall time, first send to last response;
- ``request_throughput`` (completed requests / s), ``output_throughput`` (output tokens / s),
  ``total_token_throughput`` ((input + output tokens) / s), ``goodput`` (requests / s meeting both SLOs);
- ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms``: each ``{"mean", "p50", "p90", "p99"}`` in milliseconds over
  completed requests (``null`` when there is no sample, e.g. no TPOT when every output has one token);
- ``request_rate`` (requests / s, the string ``"inf"`` for all at once, ``null`` at fixed concurrency) and
  ``concurrency`` (``null`` at a request rate): how the load was offered.

The JSON result (:func:`result_json`) is the first pass's summary at top level (for a single pass: the only
one), plus ``settings`` (the workload and flags used) and ``runs``: every pass's summary in order, one per
request rate of a sweep (a list of one otherwise). The first pass stays at top level so that a script written
for a single pass reads the same keys whether or not a sweep was run.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass

from pdserve.bench import metrics
from pdserve.bench.runner import PassResult

LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in milliseconds; ``None`` does not constrain."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None


def latency_samples_ms(result: PassResult) -> dict[str, list[float]]:
    """Every latency sample of the pass's completed requests, in milliseconds, by key of :data:`LATENCY_KEYS`."""
    samples: dict[str, list[float]] = {key: [] for key in LATENCY_KEYS}
    for record in result.records:
        if not record.completed:
            continue
        ttft, tpot = metrics.ttft_s(record), metrics.tpot_s(record)
        if ttft is not None:
            samples["ttft_ms"].append(ttft * 1e3)
        if tpot is not None:
            samples["tpot_ms"].append(tpot * 1e3)
        samples["itl_ms"] += [gap * 1e3 for gap in metrics.itls_s(record.arrivals)]
        samples["e2e_ms"].append(metrics.e2e_s(record) * 1e3)
    return samples


def latency_stats(values_ms: list[float]) -> dict[str, float | None]:
    """``{"mean", "p50", "p90", "p99"}`` of ``values_ms`` (all ``None`` when empty)."""
    stats: dict[str, float | None] = {"mean": sum(values_ms) / len(values_ms) if values_ms else None}
    for q in PERCENTILES:
        stats[f"p{q}"] = metrics.percentile(values_ms, q)
    return stats


def summarize(result: PassResult, slo: Slo) -> dict:
    """The summary object of one pass (keys in the module docstring)."""
    done = [r for r in result.records if r.completed]
    duration_s = result.duration_s
    input_tokens = sum(r.input_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)

    def per_s(n: float) -> float:
        return n / duration_s if duration_s > 0 else 0.0

    slo_ttft_s = None if slo.ttft_ms is None else slo.ttft_ms / 1e3
    slo_tpot_s = None if slo.tpot_ms is None else slo.tpot_ms / 1e3
    rate = result.request_rate
    summary = {
        "request_rate": "inf" if rate is not None and math.isinf(rate) else rate,
        "concurrency": result.concurrency,
        "completed": len(done),
        "failed": len(result.records) - len(done),
        "errors": dict(sorted(Counter(r.error for r in result.records if not r.completed).items())),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "duration_s": duration_s,
        "request_throughput": per_s(len(done)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "goodput": metrics.goodput(result.records, duration_s, slo_ttft_s, slo_tpot_s),
    }
    for key, values in latency_samples_ms(result).items():
        summary[key] = latency_stats(values)
    return summary


def result_json(runs: list[dict], settings: dict) -> dict:
    """The JSON result: the first run's summary at top level, ``settings``, and ``runs`` (all summaries)."""
    if not runs:
        raise ValueError("a result needs at least one run")
    return {**runs[0], "settings": settings, "runs": runs}


def write_json(path: str, result: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


def load_label(summary: dict) -> str:
    """How a pass offered its load, for titles and legends: ``"rate 2/s"``, ``"rate inf"``, ``"concurrency 4"``."""
    if summary["concurrency"] is not None:
        return f"concurrency {summary['concurrency']}"
    rate = summary["request_rate"]
    return "rate inf" if rate == "inf" else f"rate {rate:g}/s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_summary(summary: dict, slo: Slo) -> str:
    """One pass as a table for people."""
    slo_parts = [f"TTFT <= {slo.ttft_ms:g} ms" if slo.ttft_ms is not None else "",
                 f"TPOT <= {slo.tpot_ms:g} ms" if slo.tpot_ms is not None else ""]
    slo_text = ", ".join(p for p in slo_parts if p) or "none"
    errors = ", ".join(f"{name} x{n}" for name, n in summary["errors"].items()) or "none"
    rows = [
        ("Requests completed / failed", f"{summary['completed']} / {summary['failed']}"),
        ("Errors", errors),
        ("Duration (s)", f"{summary['duration_s']:.2f}"),
        ("Input / output tokens", f"{summary['input_tokens']} / {summary['output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
        (f"Goodput (req/s; SLO: {slo_text})", f"{summary['goodput']:.2f}"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"==== pdserve bench: {load_label(summary)} ===="]
    lines += [f"{name.ljust(width)}  {value}" for name, value in rows]
    lines.append(f"{'Latency (ms)':<12}" + "".join(f"{h:>12}" for h in ("mean", "p50", "p90", "p99")))
    for key in LATENCY_KEYS:
        stats = summary[key]
        name = key.removesuffix("_ms").upper()
        lines.append(f"{name:<12}" + "".join(f"{_ms(stats[s]):>12}" for s in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)


def format_sweep(runs: list[dict]) -> str:
    """One line per pass of a sweep: load, throughput, goodput and p99 latencies."""
    header = ("LOAD", "REQ/S", "TOK/S", "GOODPUT", "P99 TTFT MS", "P99 TPOT MS", "P99 ITL MS", "FAILED")
    rows = [header]
    for run in runs:
        rows.append((load_label(run), f"{run['request_throughput']:.2f}", f"{run['output_throughput']:.2f}",
                     f"{run['goodput']:.2f}", _ms(run["ttft_ms"]["p99"]), _ms(run["tpot_ms"]["p99"]),
                     _ms(run["itl_ms"]["p99"]), str(run["failed"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
