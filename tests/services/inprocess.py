"""A whole cluster inside the test process (threads): Redis, workers and router, for fault-injection tests."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

from services.decode import main as decode_main
from services.prefill import main as prefill_main
from services.router import main as router_main
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig
from tests.redis_server import RedisServer


@dataclass
class Cluster:
    redis_url: str
    router: str = ""
    router_http: str = ""  # the router's HTTP front: /metrics, /healthz, /readyz
    workers: dict[str, str] = field(default_factory=dict)  # id -> address
    metrics: dict[str, str] = field(default_factory=dict)  # id -> HTTP address of its /metrics


@contextmanager
def inprocess_cluster(model_dir: str, *, prefill: list[dict], decode: list[dict], router: dict | None = None,
                      redis_options: dict | None = None):
    """``prefill``/``decode``: one dict of WorkerConfig overrides per worker (``worker_id`` required).
    ``redis_options``: keyword arguments of :class:`~tests.redis_server.RedisServer` (``password``, ``tls``);
    every service gets its ``url``."""
    with RedisServer(**(redis_options or {})) as redis:
        stop = threading.Event()
        cluster = Cluster(redis_url=redis.url)
        threads = []

        def start(run, config, name):
            ready = threading.Event()
            addr = {}

            def on_ready(address, http_address):
                addr["a"], addr["http"] = address, http_address
                ready.set()

            t = threading.Thread(target=run, args=(config,), kwargs=dict(stop_event=stop, on_ready=on_ready),
                                 daemon=True, name=name)
            t.start()
            threads.append(t)
            if not ready.wait(120):
                raise RuntimeError(f"{name} did not start")
            return addr["a"], addr["http"]

        try:
            for role, specs, run in (("decode", decode, decode_main.run), ("prefill", prefill, prefill_main.run)):
                for spec in specs:
                    settings = dict(model=model_dir, redis_url=redis.url, kv_cache_memory=5e7, heartbeat_ttl_s=3.0)
                    cfg = WorkerConfig(**{**settings, **spec})
                    wid = spec["worker_id"]
                    cluster.workers[wid], cluster.metrics[wid] = start(run, cfg, wid)
            rcfg = RouterConfig(model=model_dir, redis_url=redis.url, port=0, http_port=0, registry_refresh_s=0.2,
                                **(router or {}))
            cluster.router, cluster.router_http = start(router_main.run, rcfg, "router")
            yield cluster
        finally:
            stop.set()
            for t in threads:
                t.join(30)
