"""Runs one prefill or decode worker: model → engine loop → gRPC server → registry → serve → drain.

:func:`serve_worker` is the whole life of a worker process:

1. load the model and build the engine (its loop thread owns it from then on); with ``--tensor-parallel-size N``
   it is rank 0 of N processes of this host (:func:`~common.engine.tp_launcher.launch_engine`: N-1 follower
   processes are spawned here);
2. build the role's servicer, the gRPC server (health NOT_SERVING until registered, reflection);
3. register in Redis and heartbeat every second with the engine's load (a Redis outage is survived: the
   heartbeater re-registers when it returns);
4. serve; health turns SERVING;
5. on SIGTERM/SIGINT: health NOT_SERVING, deregister, stop taking new work, let in-flight requests finish
   (up to ``drain_timeout_s``), stop the engine loop, close the engine, exit 0. The engine is closed on every
   way out (a failed start too), so no tensor-parallel follower process outlives the worker.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from common.engine import attention
from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.engine.engine_loop import EngineLoop
from common.engine.identity import ModelIdentity
from common.engine.kv_tiers import KVTiers, RedisKVStore
from common.engine.loader import load_model
from common.engine.omp_teams import release_team
from common.heap import freeze_startup_objects
from common.http.server import HttpFront
from common.metrics.gpu import GpuMonitor
from common.metrics.worker import WorkerMetrics
from common.obs import Tracing
from common.rpc.server import AsyncioServer, build_server, hold_port, stop_on_signals
from common.rpc.tls import TlsFiles
from common.security.auth import Authenticator
from common.security.kv_crypto import KVCipher
from common.state.prefix_index import PrefixIndex, PrefixPublisher
from common.state.redis_client import connect, describe_error
from common.state.registry import Heartbeater, WorkerInfo, WorkerRegistry
from pdserve import __version__
from services.worker.config import WorkerConfig
from services.worker.warmup import admin_route, prompt_ids, read_warmup_file, warm_up

log = logging.getLogger(__name__)


@dataclass
class WorkerObs:
    """The worker's observability objects and state, built by :func:`serve_worker` for the role's parts."""

    metrics: WorkerMetrics
    tracing: Tracing
    draining: Callable[[], bool] = lambda: False  # True once SIGTERM came: take no new requests


WORKER_SPARE_THREADS = 16  # gRPC threads beyond --max-pending-requests: health checks, releases, cancels


@dataclass
class WorkerParts:
    """What a role contributes: its servicer registration, service names and a periodic tick."""

    add_to_server: Callable[[grpc.Server | AsyncioServer], None]
    service_names: list[str]
    tick: Callable[[], None] | None = None  # called about every 0.2 s (e.g. lease expiry)
    num_inflight: Callable[[], int] | None = None  # requests still being served (for the drain)
    on_stop: Callable[[], None] | None = None  # release the role's resources (after the server stopped)
    details: Callable[[], dict] | None = None  # the role's own figures for /healthz and /readyz
    use_asyncio: bool = False  # serve from build_server's asyncio server (the role has async handlers)


def block_placement(role: str, config: WorkerConfig) -> str:
    """``--kv-block-placement`` with ``auto`` resolved: contiguous where the worker's KV moves by NIXL block writes
    (a prefill worker with ``--kv-transport nixl``, a decode worker with ``--kv-nixl``; one process; not turned off
    by ``PDSERVE_NIXL_BLOCKS=0``): there a request's blocks in few stretches mean few, long writes; else lru, which
    keeps the most recent cached prefixes (a decode worker's sessions) longest."""
    if config.kv_block_placement != "auto":
        return config.kv_block_placement
    nixl = {"prefill": config.kv_transport == "nixl", "decode": config.kv_nixl}.get(role, False)
    if not nixl or config.tensor_parallel_size > 1:
        return "lru"
    from common.kv_transfer.nixl_blocks import blocks_enabled

    return "contiguous" if blocks_enabled() else "lru"


def weight_layout(role: str, config: WorkerConfig) -> str:
    """``--weight-layout`` with ``auto`` resolved: prefill on a prefill worker (its steps are batches of prompt
    tokens; a prompt's first token is all it samples), else decode."""
    if config.weight_layout != "auto":
        return config.weight_layout
    return "prefill" if role == "prefill" else "decode"


def build_engine(config: WorkerConfig, role: str = "") -> LLMEngine:
    """The worker's engine; with ``--tensor-parallel-size N`` > 1, rank 0 of N processes of this host (the N-1
    followers are spawned here; ``engine.close()`` stops them)."""
    if not config.model:
        raise ValueError("a worker needs --model (a local model directory)")
    check_tensor_parallel_settings(config)
    config = dataclasses.replace(config, kv_block_placement=block_placement(role, config),
                                 weight_layout=weight_layout(role, config))
    load_kwargs = dict(dtype=config.dtype, allow_pickle=config.allow_pickle_weights,
                       quantization=config.quantization)
    if config.tensor_parallel_size > 1:
        from common.engine.tp_launcher import launch_engine

        return launch_engine(config.model, EngineConfig.from_settings(config),
                             tensor_parallel_size=config.tensor_parallel_size, device=config.device, **load_kwargs)
    loaded = load_model(config.model, device=config.device, **load_kwargs)
    return LLMEngine(loaded, EngineConfig.from_settings(config))


def check_tensor_parallel_settings(config: WorkerConfig) -> None:
    """ValueError naming the flags, before anything loads, for what the engine refuses with tensor parallelism."""
    size = config.tensor_parallel_size
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"--tensor-parallel-size must be a positive integer, got {size!r}")
    if size == 1:
        return
    refused = []
    if config.kv_host_cache_blocks > 0 or config.kv_shared_cache_blocks > 0:
        refused.append("KV spill tiers (--kv-host-cache-blocks, --kv-shared-cache-blocks)")
    if config.quantization != "none":
        refused.append(f"--quantization {config.quantization}")
    if refused:
        raise ValueError(f"--tensor-parallel-size {size} does not work with {' or '.join(refused)} yet: use "
                         "--tensor-parallel-size 1 or turn them off")


def attach_kv_tiers(engine: LLMEngine, identity: ModelIdentity, config: WorkerConfig) -> None:
    """The prefix cache's spill tiers, when configured: host memory, then blocks shared through Redis by every
    worker whose KV identity (model, dtype, quantization, block shape) and KV encryption key match.

    A ``kv_encryption_key_file`` is read even when no shared tier uses it, so a bad key file fails the start
    (ValueError naming the file)."""
    cipher = KVCipher.from_key_file(config.kv_encryption_key_file) if config.kv_encryption_key_file else None
    if not engine.config.prefix_caching or not (config.kv_host_cache_blocks or config.kv_shared_cache_blocks):
        return
    shared = None
    if config.kv_shared_cache_blocks:
        spec = engine.kv_spec
        space = f"{identity.model_fingerprint[:16]}-{str(spec.dtype).removeprefix('torch.')}-{spec.block_size}"
        if identity.quantization != "none":  # quantized weights compute other KV (unquantized: the older space)
            space += f"-{identity.quantization}"
        shared = RedisKVStore(connect(config.redis_url), prefix=config.redis_prefix, space=space,
                              shape=(spec.num_layers, 2, spec.num_kv_heads, spec.block_size, spec.head_dim),
                              dtype=spec.dtype, ttl_s=config.kv_shared_cache_ttl_s,
                              max_blocks=config.kv_shared_cache_blocks, cipher=cipher)  # fmt: skip
        log.info("shared KV tier in Redis, key space %s (%s)", shared.space,
                 "AES-256-GCM" if cipher else "plaintext")
    engine.attach_kv_tiers(KVTiers(config.kv_host_cache_blocks, shared))


def serve_worker(
    role: str,
    config: WorkerConfig,
    make_parts: Callable[[EngineLoop, ModelIdentity, WorkerObs], WorkerParts],
    *,
    stop_event: threading.Event | None = None,
    on_ready: Callable[[str, str], None] | None = None,
) -> int:
    """Run a worker until SIGTERM/SIGINT (or ``stop_event``); returns the exit status (0 after a clean drain).

    ``on_ready(address, metrics_address)`` is called once the worker serves and is registered (tests use it).
    Besides gRPC, the worker serves ``/metrics``, ``/healthz`` and ``/readyz`` over HTTP on
    ``config.metrics_port`` (``metrics_address``), and ``POST /admin/warmup``, which needs an API key or JWT
    when ``--api-key-file``/``PDSERVE_API_KEYS``/``--jwt-*`` are set (:mod:`common.security.auth`). With
    ``--tls-*`` the gRPC port speaks only mutual TLS (:mod:`common.rpc.tls`); the HTTP port stays plaintext.
    """
    stop_event = stop_event or threading.Event()
    authenticator = Authenticator.from_config(config)  # before the model loads: a bad key file fails fast
    tls = TlsFiles.from_config(config)  # None: plaintext gRPC
    if tls is not None:
        tls.load()  # before the model loads: a bad certificate or key fails fast (ValueError naming the file)
    # The gRPC port, held from here until the server binds it: neither the model's load (tensor-parallel ranks
    # connect through ephemeral ports) nor NIXL's UCX listeners may be handed it as an ephemeral one (hold_port).
    held = hold_port(config.host, config.port)
    try:
        engine = build_engine(config, role)
    except BaseException:
        if held is not None:
            held.close()
        raise
    loop: EngineLoop | None = None
    try:
        identity = ModelIdentity.of_engine(engine)
        attach_kv_tiers(engine, identity, config)
        heartbeater: Heartbeater | None = None
        # None on the CPU or without nvidia-ml-py: no GPU figures; with tensor parallelism every rank's GPU
        gpu = GpuMonitor.for_device(engine.device, ranks=config.tensor_parallel_size)
        metrics = WorkerMetrics(role, lambda: loop.stats, lambda: heartbeater is not None and heartbeater.connected,
                                gpu=gpu)
        loop = EngineLoop(engine, name=f"{role}-engine", on_request_finished=metrics.observe_request).start()
        release_team()  # the engine steps on the loop's thread now: this one's OpenMP team (loading) would only
        # make libgomp put the step's idle threads to sleep (see common.engine.omp_teams)
        tracing = Tracing(f"pdserve-{role}", config.otlp_endpoint)
        parts = make_parts(loop, identity, WorkerObs(metrics, tracing, stop_event.is_set))
        if held is not None:
            held.close()
        # a thread for every request the worker may hold (a Prefill call or a PushKv stream holds one until its
        # KV is sent): with fewer, calls past the pool waited unseen and the batch could not fill
        server, port, health = build_server(parts.add_to_server, parts.service_names, host=config.host,
                                            port=config.port, tls=tls, use_asyncio=parts.use_asyncio,
                                            max_workers=config.max_pending_requests + WORKER_SPARE_THREADS)
        address = f"{config.advertise_host or config.host}:{port}"
        worker_id = config.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
        started_at = time.time()

        def not_ready() -> list[str]:
            reasons = []
            if stop_event.is_set():
                reasons.append("draining: stopping, takes no new requests")
            if heartbeater is None or not heartbeater.ever_connected:  # a Redis outage later is no reason: the
                reasons.append("not registered in Redis")  # routers keep their view of it (details say degraded)
            if not loop.running:
                reasons.append("engine loop stopped")
            return reasons

        def details() -> dict:
            stats = loop.stats
            redis_state = "ok" if heartbeater is not None and heartbeater.connected else "degraded"
            return {"role": role, "id": worker_id, "redis": redis_state,
                    "kv_block_placement": engine.block_pool.placement,
                    "weight_layout": engine.config.weight_layout,
                    "prefill_attention": ("kernel" if engine.runner.prefill_kernel
                                          and not attention.cpu_prefill_dropped() else "sdpa"),
                    "num_requests_running": stats.num_requests_running,
                    "num_requests_waiting": stats.num_requests_waiting, **(parts.details() if parts.details else {}),
                    **({"gpu": gpu.health()} if gpu is not None else {})}

        if config.warmup_file:  # before serving: the router's first view already finds the prefixes cached
            result = warm_up(loop, prompt_ids(loop, read_warmup_file(config.warmup_file)))
            log.info("warm-up: %s", result)
        http = HttpFront(config.host, config.metrics_port, authenticator=authenticator)  # /admin/*: keys when set
        http.add_observability(metrics.registry, not_ready, details)
        http.route("POST", "/admin/warmup", admin_route(loop))
        http.start()
        metrics_address = f"{config.advertise_host or config.host}:{http.port}"

        def info() -> WorkerInfo:
            stats = loop.stats
            return WorkerInfo(
                id=worker_id, role=role, address=address, host=socket.gethostname(), pid=os.getpid(),
                model=identity.model_fingerprint, version=__version__,
                num_requests_running=stats.num_requests_running, num_requests_waiting=stats.num_requests_waiting,
                kv_blocks_used=stats.kv_blocks_used, kv_blocks_total=stats.kv_blocks_total,
                kv_blocks_cached=stats.kv_blocks_cached, block_size=engine.config.block_size,
                metrics_address=metrics_address, started_at=started_at, updated_at=time.time(),
                state="draining" if stop_event.is_set() else "ready",
            )  # fmt: skip

        redis_client = connect(config.redis_url)
        registry = WorkerRegistry(redis_client, prefix=config.redis_prefix, ttl_s=config.heartbeat_ttl_s)
        publisher = None
        if engine.config.prefix_caching:  # the router's prefix index learns what this worker's cache holds
            engine.block_pool.name_events = deque()
            index = PrefixIndex(redis_client, prefix=config.redis_prefix, ttl_s=config.heartbeat_ttl_s)
            publisher = PrefixPublisher(index, worker_id, engine.block_pool.name_events)
        heartbeater = Heartbeater(registry, info, interval_s=min(1.0, config.heartbeat_ttl_s / 3))
        frozen = freeze_startup_objects()  # the model, torch, gRPC: never scanned again by the collector
        log.debug("%d startup objects frozen out of the garbage collector's scans", frozen)
        stop_on_signals(stop_event)  # before it serves: a SIGTERM once ready is a drain
        server.start()
        try:
            registry.register(info())
        except Exception as exc:  # noqa: BLE001 - Redis down at start: the heartbeater keeps trying
            log.warning("could not register in %s; retrying in the background", describe_error(exc, config.redis_url))
        heartbeater.start()
        health.set_serving(True)
        log.info("%s worker %s serving on %s (%s), metrics on %s (model %s)", role, worker_id, address,
                 "mutual TLS" if tls else "plaintext", metrics_address, identity.model_fingerprint[:12])
        if on_ready is not None:
            on_ready(address, metrics_address)

        while not stop_event.wait(0.2):
            if parts.tick is not None:
                parts.tick()
            if publisher is not None:
                try:
                    publisher.flush()
                except Exception as exc:  # noqa: BLE001 - Redis away: the heartbeater reports it; retry next tick
                    log.debug("prefix index not published: %s", exc)

        # -- drain --------------------------------------------------------------------------------------------
        log.info("%s worker %s draining", role, worker_id)
        health.set_serving(False)
        heartbeater.stop()
        try:
            registry.deregister(worker_id)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not deregister %s: %s", worker_id, exc)
        deadline = time.monotonic() + config.drain_timeout_s
        def busy() -> bool:
            stats = loop.stats
            inflight = parts.num_inflight() if parts.num_inflight else 0
            return bool(stats.num_requests_running or stats.num_requests_waiting or inflight)

        while time.monotonic() < deadline and busy():
            time.sleep(0.05)
        server.stop(grace=1.0).wait(5.0)
        http.stop()
        if parts.on_stop is not None:
            parts.on_stop()
        if gpu is not None:
            gpu.close()
        loop.stop()
        tracing.shutdown()
        log.info("%s worker %s stopped", role, worker_id)
        return 0
    except BaseException:  # a failed start (or drain): the engine thread must be gone before the engine closes
        if loop is not None:
            loop.stop()
        raise
    finally:
        if held is not None:
            held.close()  # a start that failed before the server bound the port (a second close does nothing)
        engine.close()  # with --tensor-parallel-size: stops and joins the follower processes (idempotent)
