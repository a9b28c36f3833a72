"""The router's metrics (user-facing figures): what ``/metrics`` on its ``--http-port`` shows.

Latencies are measured where the client's experience is decided: from the moment a request reaches the
router to the moment each message leaves it, so routing, reservation, prefill, KV transfer and relaying
are all inside TTFT. Worker counts, pool queues and KV usage are read from the router's registry view at
scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.metrics import names as n
from common.metrics.registry import build
from common.metrics.repetition import repeated_ngram_share
from common.state.rate_limit import LIMIT_NAMES
from common.state.registry import WORKER_ROLES, WORKER_STATES, WorkerInfo

FINISH_REASONS = ("stop", "length", "abort")
FAILURE_CODES = ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED",
                 "DATA_LOSS", "FAILED_PRECONDITION", "INTERNAL")  # fmt: skip


class _PoolCollector(Collector):
    def __init__(self, workers: Callable[[], Sequence[WorkerInfo]], redis_up: Callable[[], bool]) -> None:
        self._workers = workers
        self._redis_up = redis_up

    def collect(self):
        workers = list(self._workers())
        by_state = GaugeMetricFamily(n.WORKERS.name, n.WORKERS.help, labels=n.WORKERS.labels)
        waiting = GaugeMetricFamily(n.POOL_REQUESTS_WAITING.name, n.POOL_REQUESTS_WAITING.help, labels=("role",))
        running = GaugeMetricFamily(n.POOL_REQUESTS_RUNNING.name, n.POOL_REQUESTS_RUNNING.help, labels=("role",))
        kv = GaugeMetricFamily(n.POOL_KV_USAGE.name, n.POOL_KV_USAGE.help, labels=("role",))
        for role in WORKER_ROLES:
            mine = [w for w in workers if w.role == role]
            for state in WORKER_STATES:
                by_state.add_metric((role, state), sum(1 for w in mine if w.state == state))
            waiting.add_metric((role,), sum(w.num_requests_waiting for w in mine))
            running.add_metric((role,), sum(w.num_requests_running for w in mine))
            kv.add_metric((role,), sum(w.kv_blocks_used for w in mine) / max(1, sum(w.kv_blocks_total for w in mine)))
        yield from (by_state, waiting, running, kv)
        yield GaugeMetricFamily(n.REDIS_UP.name, n.REDIS_UP.help, value=1.0 if self._redis_up() else 0.0)


class RouterMetrics:
    """Built by the router's entry point; ``registry`` is what its HTTP front serves."""

    def __init__(self, workers: Callable[[], Sequence[WorkerInfo]], redis_up: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(workers, redis_up))
        pooled = {n.WORKERS, n.POOL_REQUESTS_WAITING, n.POOL_REQUESTS_RUNNING, n.POOL_KV_USAGE, n.REDIS_UP}
        m = build((s for s in n.ROUTER_METRICS if s not in pooled), self.registry)
        self.ttft, self.itl = m[n.TIME_TO_FIRST_TOKEN.name], m[n.INTER_TOKEN_LATENCY.name]
        self.tpot, self.e2e = m[n.TIME_PER_OUTPUT_TOKEN.name], m[n.E2E_REQUEST_LATENCY.name]
        self.running, self.requests = m[n.ROUTER_REQUESTS_RUNNING.name], m[n.REQUESTS_RECEIVED.name]
        self.prompt_tokens, self.generation_tokens = m[n.PROMPT_TOKENS.name], m[n.GENERATION_TOKENS.name]
        self.success, self.failures = m[n.REQUEST_SUCCESS.name], m[n.REQUEST_FAILURES.name]
        self.retries, self.repetition = m[n.HANDOFF_RETRIES.name], m[n.REPETITION.name]
        self.migrations = m[n.REQUEST_MIGRATIONS.name]
        self.rate_limited = m[n.RATE_LIMITED_REQUESTS.name]
        for reason in FINISH_REASONS:  # labelled series appear once touched: touch the usual ones
            self.success.labels(reason)
        for code in FAILURE_CODES:
            self.failures.labels(code)
            self.retries.labels(code)
        for limit in LIMIT_NAMES:
            self.rate_limited.labels(limit)

    def start_request(self, num_prompt_tokens: int) -> RequestTimer:
        """A request arrived (valid or not, it counts toward the request rate)."""
        self.requests.inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.running.inc()
        return RequestTimer(self)


class RequestTimer:
    """One request's latencies at the router; ends with exactly one :meth:`finish` or :meth:`fail`."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self._m = metrics
        self.start_s = time.monotonic()
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.first_token_at = 0.0  # unix time, for the request's trace
        self.last_token_at = 0.0
        self.token_ids: list[int] = []
        self._done = False

    def on_tokens(self, token_ids: Sequence[int]) -> None:
        """A message carrying ``token_ids`` is about to leave for the client."""
        if not token_ids:
            return
        now = time.monotonic()
        if self.first_token_s is None:
            self.first_token_s = now
            self.first_token_at = time.time()
            self._m.ttft.observe(now - self.start_s)
        else:
            gap = (now - self.last_token_s) / len(token_ids)
            for _ in token_ids:
                self._m.itl.observe(gap)
        self.last_token_s = now
        self.last_token_at = time.time()
        self.token_ids.extend(token_ids)
        self._m.generation_tokens.inc(len(token_ids))

    def finish(self, reason: str) -> None:
        if self._end():
            return
        self._m.e2e.observe(time.monotonic() - self.start_s)
        self._m.success.labels(reason or "abort").inc()
        if self.first_token_s is not None and len(self.token_ids) > 1:
            self._m.tpot.observe((self.last_token_s - self.first_token_s) / (len(self.token_ids) - 1))
        share = repeated_ngram_share(self.token_ids)
        if share is not None:
            self._m.repetition.observe(share)

    def fail(self, code: str) -> None:
        if self._end():
            return
        self._m.failures.labels(code).inc()

    def _end(self) -> bool:
        """True if already ended (a second finish/fail is ignored); else marks it ended."""
        if self._done:
            return True
        self._done = True
        self._m.running.dec()
        return False
