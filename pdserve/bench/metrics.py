"""What one bench request measured, and the figures derived from it: TTFT, TPOT, ITL, E2E, goodput. Pure.

Times are ``time.perf_counter()`` seconds. Definitions (the router's metrics use the same ones):

- TTFT: send → the first message carrying tokens;
- ITL: the gaps between consecutive token-carrying messages; a message of ``k`` tokens that arrives ``d``
  seconds after the previous one counts as ``k`` gaps of ``d / k``. Extra tokens of the first message are
  not gaps (they arrive with the first token);
- TPOT (per request): (last token time − first token time) / (output tokens − 1); none with < 2 tokens;
- E2E: send → the end of the stream;
- goodput: completed requests per second whose TTFT and TPOT both meet their SLOs (DistServe's definition);
  an SLO that is ``None`` does not constrain, and a request without a TPOT meets any TPOT SLO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """One request as the bench saw it. ``error`` is the status name of a failed request, ``None`` if completed."""

    session_index: int
    turn_index: int
    input_tokens: int
    max_tokens: int
    send_s: float
    end_s: float
    # (arrival time, number of tokens) of each message that carried tokens, in arrival order
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    output_tokens: int = 0  # the server's reported count when it gave one, else the tokens received
    error: str | None = None

    @property
    def completed(self) -> bool:
        return self.error is None


def ttft_s(record: RequestRecord) -> float | None:
    return record.arrivals[0][0] - record.send_s if record.arrivals else None


def e2e_s(record: RequestRecord) -> float:
    return record.end_s - record.send_s


def tpot_s(record: RequestRecord) -> float | None:
    if record.output_tokens < 2 or not record.arrivals:
        return None
    return (record.arrivals[-1][0] - record.arrivals[0][0]) / (record.output_tokens - 1)


def itls_s(arrivals: list[tuple[float, int]]) -> list[float]:
    """The inter-token gaps of one request: ``k`` gaps of ``d / k`` for each later message of ``k`` tokens."""
    gaps = []
    for (prev_s, _), (now_s, num_tokens) in zip(arrivals, arrivals[1:]):
        gaps += [(now_s - prev_s) / num_tokens] * num_tokens
    return gaps


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) with linear interpolation (numpy's default); ``None`` for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q!r}")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def meets_slo(record: RequestRecord, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    """Whether a completed request meets both SLOs (``None``: that SLO does not constrain)."""
    if not record.completed:
        return False
    ttft = ttft_s(record)
    if slo_ttft_s is not None and (ttft is None or ttft > slo_ttft_s):
        return False
    tpot = tpot_s(record)
    return slo_tpot_s is None or tpot is None or tpot <= slo_tpot_s


def goodput(records: list[RequestRecord], duration_s: float, slo_ttft_s: float | None,
            slo_tpot_s: float | None) -> float:
    """Requests per second that completed within both SLOs."""
    num_good = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records)
    return num_good / duration_s if duration_s > 0 else 0.0
