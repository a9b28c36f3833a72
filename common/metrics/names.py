"""Every Prometheus metric pdserve exposes: names, types, labels, help and buckets. The one place they live.

Names follow vLLM's with the ``pdserve:`` prefix. Counters are declared without ``_total``; the exposition
(and PromQL) adds it: ``pdserve:generation_tokens`` is scraped as ``pdserve:generation_tokens_total``.
Histograms add ``_bucket``, ``_sum`` and ``_count``.

Where a figure lives:

- the router (user-facing; only it sees routing, queueing, KV transfer and relaying): TTFT, inter-token
  latency, per-request TPOT, end-to-end latency, requests running, prompt and generation tokens delivered,
  finished requests by reason, failed requests by status, the repetition of each response, worker counts
  by role and state, pool-wide queue depth and KV usage from the registry, Redis reachability, requests
  refused by rate limits;
- each worker (engine-side): requests running and waiting, KV usage, prefix cache queries and hits, prompt
  and generation tokens computed, preemptions, queue, prefill and decode time per request, KV transfer
  seconds and bytes (``direction`` = ``sent`` on prefill, ``received`` on decode), encrypted shared-tier KV
  blocks that failed authentication, Redis reachability; on CUDA with ``nvidia-ml-py`` installed, memory and
  utilization of each GPU the worker uses (:mod:`common.metrics.gpu`; absent otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "pdserve:"

# Latencies from ~1 ms (a GPU decode step) to minutes (a long CPU prefill, a saturated queue).
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                     1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)  # fmt: skip
# Per-token gaps: ~1 ms on a GPU to seconds on a busy CPU.
TOKEN_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                           0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
RATIO_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
REPETITION_NGRAM = 4  # the repetition signal counts repeated 4-grams of token ids


@dataclass(frozen=True)
class MetricSpec:
    name: str  # without the exposition suffix (_total, _bucket, ...)
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


def _m(name: str, kind: str, help_: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] = ()) -> MetricSpec:
    return MetricSpec(PREFIX + name, kind, help_, labels, buckets)


# -- router -------------------------------------------------------------------------------------------------

TIME_TO_FIRST_TOKEN = _m("time_to_first_token_seconds", "histogram",
                         "Request received at the router to its first token sent to the client.",
                         buckets=LATENCY_BUCKETS_S)
INTER_TOKEN_LATENCY = _m("inter_token_latency_seconds", "histogram",
                         "Gap between consecutive tokens sent to a client (a message of k tokens counts k gaps of "
                         "1/k of its delay).", buckets=TOKEN_LATENCY_BUCKETS_S)
TIME_PER_OUTPUT_TOKEN = _m("request_time_per_output_token_seconds", "histogram",
                           "Per request: (last token - first token) / (output tokens - 1).",
                           buckets=TOKEN_LATENCY_BUCKETS_S)
E2E_REQUEST_LATENCY = _m("e2e_request_latency_seconds", "histogram",
                         "Request received at the router to its last message sent.", buckets=LATENCY_BUCKETS_S)
ROUTER_REQUESTS_RUNNING = _m("num_requests_running", "gauge",
                             "Requests in flight (router: between received and answered; worker: in the batch).")
REQUESTS_RECEIVED = _m("requests", "counter", "Requests received (the request-rate signal for autoscaling).")
PROMPT_TOKENS = _m("prompt_tokens", "counter",
                   "Prompt tokens (router: of requests received; worker: of requests prefilled there, the ones "
                   "taken from the prefix cache included).")
GENERATION_TOKENS = _m("generation_tokens", "counter",
                       "Generated tokens (router: delivered to clients; worker: sampled by the engine).")
REQUEST_SUCCESS = _m("request_success", "counter", "Requests finished, by finish reason.", ("finished_reason",))
REQUEST_FAILURES = _m("request_failures", "counter", "Requests that ended in an error, by gRPC status.", ("code",))
REQUEST_MIGRATIONS = _m("request_migrations", "counter",
                        "Requests moved to another decode worker mid-stream (theirs failed); each move counts.")
HANDOFF_RETRIES = _m("handoff_retries", "counter", "Hand-offs retried on another worker pair, by gRPC status.",
                     ("code",))
REPETITION = _m("request_repetition_ratio", "histogram",
                f"Per response: share of its {REPETITION_NGRAM}-grams of token ids that repeat an earlier one "
                "(0 = none repeated; near 1 = looping output).", buckets=RATIO_BUCKETS)
WORKERS = _m("workers", "gauge", "Workers in the registry, by role and state (live heartbeats only).",
             ("role", "state"))
POOL_REQUESTS_WAITING = _m("pool_num_requests_waiting", "gauge",
                           "Requests waiting in the queues of a role's workers (summed from the registry).", ("role",))
POOL_REQUESTS_RUNNING = _m("pool_num_requests_running", "gauge",
                           "Requests running on a role's workers (summed from the registry).", ("role",))
POOL_KV_USAGE = _m("pool_kv_cache_usage_perc", "gauge",
                   "KV blocks used / total over a role's workers (from the registry), 0-1.", ("role",))
REDIS_UP = _m("redis_up", "gauge", "1 if the last Redis operation of this service succeeded, else 0.")
RATE_LIMITED_REQUESTS = _m("rate_limited_requests", "counter",
                           "Requests refused by a caller's rate limit (RESOURCE_EXHAUSTED / 429), by the budget "
                           "that refused them.", ("limit",))

ROUTER_METRICS = (TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, TIME_PER_OUTPUT_TOKEN, E2E_REQUEST_LATENCY,
                  ROUTER_REQUESTS_RUNNING, REQUESTS_RECEIVED, PROMPT_TOKENS, GENERATION_TOKENS, REQUEST_SUCCESS,
                  REQUEST_FAILURES, HANDOFF_RETRIES, REQUEST_MIGRATIONS, REPETITION, WORKERS, POOL_REQUESTS_WAITING,
                  POOL_REQUESTS_RUNNING, POOL_KV_USAGE, REDIS_UP, RATE_LIMITED_REQUESTS)  # fmt: skip

# -- workers ------------------------------------------------------------------------------------------------

REQUESTS_RUNNING = ROUTER_REQUESTS_RUNNING
REQUESTS_WAITING = _m("num_requests_waiting", "gauge", "Requests waiting in this worker's engine queue.")
KV_CACHE_USAGE = _m("kv_cache_usage_perc", "gauge", "KV blocks used (requests and reservations) / total, 0-1.")
KV_BLOCKS_USED = _m("kv_cache_blocks_used", "gauge", "KV blocks held by requests and reservations.")
KV_BLOCKS_TOTAL = _m("kv_cache_blocks_total", "gauge", "KV blocks in this worker's cache.")
KV_BLOCKS_CACHED = _m("kv_cache_blocks_cached", "gauge",
                      "Free KV blocks still holding a cached prefix (reused on a hit, evicted LRU when needed).")
PREFIX_CACHE_QUERIES = _m("prefix_cache_queries", "counter",
                          "Tokens of admitted requests looked up in the prefix cache.")
PREFIX_CACHE_HITS = _m("prefix_cache_hits", "counter", "Looked-up tokens whose KV came from the prefix cache.")
PREFIX_CACHE_TIER_HITS = _m("prefix_cache_tier_hits", "counter",
                            "KV blocks brought back from a spill tier of the prefix cache (host or shared).",
                            ("tier",))
KV_TIER_INTEGRITY_FAILURES = _m("kv_tier_integrity_failures", "counter",
                                "Encrypted KV blocks of the shared tier that failed authentication (tampered, "
                                "truncated or moved): deleted from Redis and recomputed, never used.")
NUM_PREEMPTIONS = _m("num_preemptions", "counter", "Requests preempted (their KV dropped, recomputed later).")
QUEUE_TIME = _m("request_queue_time_seconds", "histogram",
                "Per request: added to the engine to first scheduled.", buckets=LATENCY_BUCKETS_S)
PREFILL_TIME = _m("request_prefill_time_seconds", "histogram",
                  "Per request: first scheduled to first token sampled (prompt compute).", buckets=LATENCY_BUCKETS_S)
DECODE_TIME = _m("request_decode_time_seconds", "histogram",
                 "Per request: first token to finished, in this engine.", buckets=LATENCY_BUCKETS_S)
KV_TRANSFER_SECONDS = _m("kv_transfer_seconds", "histogram",
                         "Per request: KV transfer, first chunk queued to the decode worker's acknowledgement.",
                         ("transport",), LATENCY_BUCKETS_S)
KV_TRANSFER_BYTES = _m("kv_transfer_bytes", "counter", "KV bytes moved between workers.", ("direction",))
KV_TRANSFER_FAILURES = _m("kv_transfer_failures", "counter", "KV transfers that failed, by gRPC status.", ("code",))
GPU_MEMORY_USED = _m("gpu_memory_used_bytes", "gauge",
                     "Memory in use on a GPU this worker runs on, all processes (NVML; CUDA workers with "
                     "nvidia-ml-py only).", ("gpu",))
GPU_MEMORY_TOTAL = _m("gpu_memory_total_bytes", "gauge",
                      "Memory of a GPU this worker runs on (NVML; CUDA workers with nvidia-ml-py only).", ("gpu",))
GPU_UTILIZATION = _m("gpu_utilization_ratio", "gauge",
                     "Share of NVML's last sample period in which a kernel ran on a GPU this worker runs on, 0-1 "
                     "(CUDA workers with nvidia-ml-py only).", ("gpu",))

WORKER_METRICS = (REQUESTS_RUNNING, REQUESTS_WAITING, KV_CACHE_USAGE, KV_BLOCKS_USED, KV_BLOCKS_TOTAL,
                  KV_BLOCKS_CACHED, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PREFIX_CACHE_TIER_HITS,
                  KV_TIER_INTEGRITY_FAILURES, PROMPT_TOKENS, GENERATION_TOKENS, NUM_PREEMPTIONS, QUEUE_TIME,
                  PREFILL_TIME, DECODE_TIME, KV_TRANSFER_SECONDS, KV_TRANSFER_BYTES, KV_TRANSFER_FAILURES,
                  REDIS_UP, GPU_MEMORY_USED, GPU_MEMORY_TOTAL, GPU_UTILIZATION)  # fmt: skip


def exposed_names(spec: MetricSpec) -> tuple[str, ...]:
    """The series names a scrape shows for ``spec`` (what dashboards and alert rules may use)."""
    if spec.kind == "counter":
        return (spec.name + "_total",)
    if spec.kind == "histogram":
        return tuple(spec.name + s for s in ("_bucket", "_sum", "_count"))
    return (spec.name,)
