"""What the engine counts for metrics: cumulative counters and each finished request's stage times.

The engine thread mutates :class:`EngineCounters` and appends :class:`RequestTimings`; readers on other
threads see counters only through :class:`common.engine.engine_loop.EngineStats` snapshots and timings only
through the loop's ``on_request_finished`` callback (called on the engine thread). Times are
``time.monotonic()`` seconds; ``None`` means the stage never happened in this engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class EngineCounters:
    num_prompt_tokens: int = 0  # prompt tokens of requests that reached their first token here
    num_generation_tokens: int = 0  # tokens sampled here
    num_preemptions: int = 0
    num_prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_cache_hits: int = 0  # ... and found there


@dataclass
class RequestTimes:
    """Stage times of one request in this engine."""

    arrival_s: float  # added (or admitted with its KV)
    first_scheduled_s: float | None = None
    first_token_s: float | None = None  # the first token sampled by this engine


@dataclass(frozen=True)
class RequestTimings:
    """A request that left the engine (finished, aborted, or handed off after prefill)."""

    request_id: str
    arrival_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finished_s: float
    num_prompt_tokens: int
    num_output_tokens: int  # sampled by this engine
    finish_reason: str  # "stop" | "length" | "abort" | "prefilled"
    imported: bool  # admitted with KV from another engine (a decode worker's requests)

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled_s is None else self.first_scheduled_s - self.arrival_s

    @property
    def prefill_s(self) -> float | None:
        """First scheduled to first token, for requests whose prompt was computed here."""
        if self.imported or self.first_scheduled_s is None or self.first_token_s is None:
            return None
        return self.first_token_s - self.first_scheduled_s

    @property
    def decode_s(self) -> float | None:
        """First token to the end (imported requests: first scheduled to the end); None after prefill only."""
        if self.finish_reason == "prefilled":
            return None
        start = self.first_scheduled_s if self.imported else self.first_token_s
        return None if start is None else self.finished_s - start


def unix_time_of(monotonic_s: float | None) -> float:
    """A ``time.monotonic()`` instant as unix seconds (0.0 for None), for stage times that cross processes."""
    if monotonic_s is None:
        return 0.0
    return time.time() - (time.monotonic() - monotonic_s)
