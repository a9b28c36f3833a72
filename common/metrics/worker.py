"""A worker's metrics (engine-side figures): what ``/metrics`` on its ``--metrics-port`` shows.

Gauges and counters of the engine are read at scrape time from the engine loop's latest
:class:`~common.engine.engine_loop.EngineStats` snapshot (no lock, no work on the engine thread); the
per-request histograms are observed as requests leave the engine (``observe_request``, on the engine
thread); KV transfer figures are observed by the servicers. GPU gauges come from a
:class:`~common.metrics.gpu.GpuMonitor`, when the worker has one (CUDA and ``nvidia-ml-py``).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.engine.counters import RequestTimings
from common.engine.engine_loop import EngineStats
from common.metrics import names as n
from common.metrics.gpu import GpuCollector, GpuMonitor
from common.metrics.registry import build

_PRE_INITIALIZED_FAILURE_CODES = ("DATA_LOSS", "DEADLINE_EXCEEDED", "UNAVAILABLE")


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], redis_up: Callable[[], bool]) -> None:
        self._stats = stats
        self._redis_up = redis_up

    def collect(self):
        s = self._stats()
        gauges = ((n.REQUESTS_RUNNING, s.num_requests_running), (n.REQUESTS_WAITING, s.num_requests_waiting),
                  (n.KV_CACHE_USAGE, s.kv_blocks_used / max(1, s.kv_blocks_total)),
                  (n.KV_BLOCKS_USED, s.kv_blocks_used), (n.KV_BLOCKS_TOTAL, s.kv_blocks_total),
                  (n.KV_BLOCKS_CACHED, s.kv_blocks_cached),
                  (n.REDIS_UP, 1.0 if self._redis_up() else 0.0))  # fmt: skip
        for spec, value in gauges:
            yield GaugeMetricFamily(spec.name, spec.help, value=value)
        counters = ((n.PROMPT_TOKENS, s.num_prompt_tokens), (n.GENERATION_TOKENS, s.num_generation_tokens),
                    (n.NUM_PREEMPTIONS, s.num_preemptions), (n.PREFIX_CACHE_QUERIES, s.num_prefix_cache_queries),
                    (n.PREFIX_CACHE_HITS, s.num_prefix_cache_hits),
                    (n.KV_TIER_INTEGRITY_FAILURES, s.num_kv_tier_integrity_failures))  # fmt: skip
        for spec, value in counters:
            yield CounterMetricFamily(spec.name, spec.help, value=value)
        tiers = CounterMetricFamily(n.PREFIX_CACHE_TIER_HITS.name, n.PREFIX_CACHE_TIER_HITS.help, labels=("tier",))
        tiers.add_metric(("host",), s.num_host_tier_hits)
        tiers.add_metric(("shared",), s.num_shared_tier_hits)
        yield tiers


class WorkerMetrics:
    """Built by the worker's entry point; ``registry`` is what its HTTP front serves."""

    def __init__(self, role: str, stats: Callable[[], EngineStats], redis_up: Callable[[], bool],
                 gpu: GpuMonitor | None = None) -> None:
        """``gpu``: the per-GPU gauges are exposed only with a monitor (None: no ``pdserve:gpu_*`` series)."""
        self.role = role
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, redis_up))
        if gpu is not None:
            self.registry.register(GpuCollector(gpu))
        m = build((n.QUEUE_TIME, n.PREFILL_TIME, n.DECODE_TIME, n.KV_TRANSFER_SECONDS, n.KV_TRANSFER_BYTES,
                   n.KV_TRANSFER_FAILURES), self.registry)  # fmt: skip
        self._queue, self._prefill, self._decode = m[n.QUEUE_TIME.name], m[n.PREFILL_TIME.name], m[n.DECODE_TIME.name]
        self._xfer_s, self._xfer_bytes = m[n.KV_TRANSFER_SECONDS.name], m[n.KV_TRANSFER_BYTES.name]
        self._xfer_failures = m[n.KV_TRANSFER_FAILURES.name]
        # Labelled series show up only once touched: touch the ones this role produces, so a fresh worker's
        # scrape already lists every name dashboards and alerts use.
        if role == "prefill":
            for transport in ("grpc", "shm", "nixl"):
                self._xfer_s.labels(transport)
            for code in _PRE_INITIALIZED_FAILURE_CODES:
                self._xfer_failures.labels(code)
        self._xfer_bytes.labels("sent" if role == "prefill" else "received")

    def observe_request(self, t: RequestTimings) -> None:
        """A request left the engine (the engine loop's ``on_request_finished``)."""
        for histogram, value in ((self._queue, t.queue_s), (self._prefill, t.prefill_s), (self._decode, t.decode_s)):
            if value is not None:
                histogram.observe(max(0.0, value))

    def observe_kv_sent(self, transport: str, seconds: float, num_bytes: int) -> None:
        self._xfer_s.labels(transport).observe(seconds)
        self._xfer_bytes.labels("sent").inc(num_bytes)

    def count_kv_received(self, num_bytes: int) -> None:
        self._xfer_bytes.labels("received").inc(num_bytes)

    def count_kv_failure(self, code: str) -> None:
        self._xfer_failures.labels(code).inc()

