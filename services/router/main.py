"""Entry point of the router: ``pdserve router ...``."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from common.heap import freeze_startup_objects
from common.http.server import HttpFront
from common.metrics.router import RouterMetrics
from common.obs import Tracing
from common.rpc.server import build_server, stop_on_signals
from common.rpc.tls import TlsFiles
from common.rpc.unparsable import RejectUnparsable
from common.security.auth import Authenticator
from common.security.grpc_auth import AuthInterceptor
from common.state.prefix_index import PrefixIndex
from common.state.records import RequestStore, SessionStore
from common.state.redis_client import connect
from common.state.registry import WORKER_ROLES, WorkerRegistry
from pdserve.v1 import generate_pb2_grpc
from services.router.config import RouterConfig
from services.router.http_api import RouterHttpApi
from services.router.k8s_discovery import K8sDiscovery
from services.router.rate_limits import RouterRateLimits
from services.router.registry_view import RegistryView
from services.router.servicer import ModelInfo, RouterServicer

log = logging.getLogger(__name__)
SERVICE_NAME = "pdserve.v1.GenerateService"


def load_model_info(config: RouterConfig) -> ModelInfo:
    """Tokenizer, generation config and limits of the model, without its weights."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from common.engine.loader import ModelLoadError

    if not config.model:
        raise ValueError("the router needs --model (the model directory, for its tokenizer and config)")
    try:
        model_config = AutoConfig.from_pretrained(config.model, local_files_only=True).get_text_config()
        tokenizer = AutoTokenizer.from_pretrained(config.model, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read model directory {config.model}: {exc}") from exc
    try:
        generation_config = GenerationConfig.from_pretrained(config.model, local_files_only=True)
    except OSError:
        generation_config = None
    max_len = int(getattr(model_config, "max_position_embeddings", 0) or tokenizer.model_max_length)
    if config.max_model_len is not None:
        max_len = min(max_len, config.max_model_len)
    return ModelInfo(tokenizer, generation_config, int(model_config.vocab_size), max_len)


def served_model_name(config: RouterConfig) -> str:
    """The model id of the OpenAI API: ``--served-model-name``, else the model directory's name."""
    return config.served_model_name or os.path.basename(os.path.normpath(config.model))


def run(
    config: RouterConfig,
    *,
    stop_event: threading.Event | None = None,
    on_ready: Callable[[str, str], None] | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (or ``stop_event``). ``on_ready(address, http_address)`` is called once the
    gRPC API and the HTTP front (OpenAI API, WebSocket stream, ``/metrics``, ``/healthz``, ``/readyz``) serve.
    With API keys or JWTs configured (:mod:`common.security.auth`), both need a credential except gRPC health
    checks, ``/healthz``, ``/readyz`` and ``/metrics``. With ``--tls-*`` its calls to the workers use mutual TLS;
    with ``--public-tls-*`` the public gRPC API speaks only TLS (:mod:`common.rpc.tls`). With
    ``--k8s-prefill-service`` / ``--k8s-decode-service`` the EndpointSlices of those Services keep workers whose
    pod is not ready or terminating from new requests (:mod:`services.router.k8s_discovery`)."""
    if config.max_streams < 1:
        raise ValueError(f"--max-streams must be at least 1, got {config.max_streams}")
    if not config.pair_cooldown_s >= 0:  # NaN too
        raise ValueError(f"--pair-cooldown-s must be >= 0 seconds (0: pairs not remembered), "
                         f"got {config.pair_cooldown_s}")
    stop_event = stop_event or threading.Event()
    authenticator = Authenticator.from_config(config)  # None: auth off, every front open
    if authenticator is not None:
        log.info("authentication on: %s (open: gRPC health, /healthz, /readyz, /metrics)", authenticator.describe())
    worker_tls = TlsFiles.from_config(config)  # None: plaintext channels to the workers
    public_tls = TlsFiles.from_config(config, prefix="public_tls", mutual=False)  # None: plaintext public API
    for tls in (worker_tls, public_tls):
        if tls is not None:
            tls.load()  # before the tokenizer loads: a bad certificate or key fails fast (ValueError naming it)
    model = load_model_info(config)
    redis = connect(config.redis_url)
    discovery = K8sDiscovery.from_config(config)  # None: routing on the Redis registry alone
    view = RegistryView(WorkerRegistry(redis, prefix=config.redis_prefix), refresh_s=config.registry_refresh_s,
                        grace_s=config.registry_grace_s, routable=discovery.routable if discovery else None)
    view.start()
    if discovery is not None:
        discovery.start(view.all_workers)
    records = RequestStore(redis, prefix=config.redis_prefix, finished_ttl_s=config.record_ttl_s)
    metrics = RouterMetrics(view.all_workers, lambda: not view.degraded)
    tracing = Tracing("pdserve-router", config.otlp_endpoint)
    sessions = SessionStore(redis, prefix=config.redis_prefix, ttl_s=config.session_ttl_s)
    index = PrefixIndex(redis, prefix=config.redis_prefix)
    rate_limits = RouterRateLimits.from_config(config, redis)  # None: no limit set, no Redis call for them
    if rate_limits is not None:
        log.info("rate limits on: %d requests and %d tokens per minute per caller (0: none), %d caller(s) set "
                 "by --rate-limit-file", rate_limits.default.requests_per_min, rate_limits.default.tokens_per_min,
                 len(rate_limits.per_principal))
    servicer = RouterServicer(model, view, records, config, metrics, tracing, sessions, index, worker_tls=worker_tls,
                              rate_limits=rate_limits)
    # Streams run on an event loop; the pool (threads made as needed) serves health, reflection and the streams'
    # Redis calls, one thread per stream at most (a Redis outage slows no stream more than its own calls).
    server, port, health = build_server(
        lambda s: generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, s),
        [SERVICE_NAME], host=config.host, port=config.port, max_workers=config.max_streams, use_asyncio=True,
        interceptors=[*([AuthInterceptor(authenticator)] if authenticator else []), RejectUnparsable()], tls=public_tls,
    )  # fmt: skip

    def not_ready() -> list[str]:
        reasons = ["stopping"] if stop_event.is_set() else []
        for role in WORKER_ROLES:
            if not view.workers(role):
                reasons.append(f"no ready {role} worker in the registry")
        return reasons

    def details() -> dict:
        return {"redis": "degraded" if view.degraded else "ok",
                **{f"{role}_workers": len(view.workers(role)) for role in WORKER_ROLES},
                **(discovery.details() if discovery is not None else {})}

    http = HttpFront(config.host, config.http_port, authenticator=authenticator)
    http.add_observability(metrics.registry, not_ready, details)
    RouterHttpApi(servicer, served_model_name(config), server.loop).register(http)
    http.start()
    freeze_startup_objects()  # tokenizer, gRPC, Redis clients: out of the collector's way (common.heap)
    stop_on_signals(stop_event)  # before it serves: a SIGTERM once ready is a drain
    server.start()
    health.set_serving(True)
    address = f"{config.host}:{port}"
    log.info("router serving on %s (%s), HTTP on %s (model %s; workers over %s)", address,
             "TLS" if public_tls else "plaintext", http.address, config.model,
             "mutual TLS" if worker_tls else "plaintext")
    if on_ready is not None:
        on_ready(address, http.address)
    while not stop_event.wait(0.2):  # timed: see stop_on_signals
        pass
    health.set_serving(False)
    server.stop(grace=config.drain_timeout_s).wait(config.drain_timeout_s + 5.0)
    http.stop()
    view.stop()
    if discovery is not None:
        discovery.stop()
    tracing.shutdown()
    return 0
