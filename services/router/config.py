"""Settings of the router (flags, ``PDSERVE_*`` environment variables, ``--config`` YAML)."""

from __future__ import annotations

from dataclasses import dataclass, field


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class RouterConfig:
    model: str = field(default="", metadata=_help("model directory (the router loads only its tokenizer and config)"))
    host: str = field(default="127.0.0.1", metadata=_help("address to listen on"))
    port: int = field(default=50051, metadata=_help("gRPC port of the public API (0: any free port)"))
    http_port: int = field(
        default=8000, metadata=_help("HTTP port: OpenAI API, WebSocket, /metrics, /healthz, /readyz (0: any free)")
    )
    served_model_name: str = field(default="", metadata=_help("model id of the OpenAI API (default: --model's name)"))
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata=_help("Redis holding the registry"))
    redis_prefix: str = field(default="pdserve:", metadata=_help("prefix of every Redis key"))
    default_max_tokens: int = field(default=64, metadata=_help("max_tokens when a request gives none"))
    max_model_len: int | None = field(default=None, metadata=_help("context length (default: the model's)"))
    registry_refresh_s: float = field(default=0.5, metadata=_help("how often the worker list is re-read"))
    registry_grace_s: float = field(
        default=5.0, metadata=_help("after a Redis outage or restart, keep workers missing from it this long")
    )
    kv_lease_s: float = field(default=30.0, metadata=_help("lease of a decode worker's KV reservation"))
    max_retries: int = field(default=1, metadata=_help("retries on another worker pair when a hand-off fails"))
    worker_cooldown_s: float = field(
        default=5.0, metadata=_help("a worker that failed a call as if dead (unreachable, hung) goes last this long")
    )
    pair_cooldown_s: float = field(
        default=30.0, metadata=_help("a prefill and a decode worker whose hand-off failed because the KV did not "
                                    "reach the decode worker while both answered the router (a network split between "
                                    "them) are paired last this long (0: not remembered)")
    )
    local_prefill_threshold: int = field(
        default=0, metadata=_help("prompts shorter than this many tokens are prefilled on the decode worker (0: never)")
    )
    prefix_load_penalty_tokens: int = field(
        default=256, metadata=_help("cache-aware routing: prompt tokens one queued request on a worker is worth")
    )
    session_ttl_s: float = field(default=1800.0, metadata=_help("how long Redis keeps an idle session's record"))
    max_migrations: int = field(
        default=2, metadata=_help("times a request may move to another decode worker when its own fails mid-stream")
    )
    decode_mux: bool = field(
        default=True, metadata=_help("decode each worker's requests on one DecodeMany stream (one message a step "
                                     "for all of them); --no-decode-mux: a Decode call per request")
    )
    retry_after_s: float = field(default=1.0, metadata=_help("retry hint sent with RESOURCE_EXHAUSTED / 429"))
    request_timeout_s: float = field(default=600.0, metadata=_help("deadline of a request without a client deadline"))
    max_streams: int = field(
        default=1024, metadata=_help("Generate streams served at once over gRPC (they share one event loop); "
                                     "more calls wait for one to end")
    )
    otlp_endpoint: str = field(
        default="", metadata=_help("OTLP gRPC endpoint of traces (default: $OTEL_EXPORTER_OTLP_ENDPOINT)")
    )
    drain_timeout_s: float = field(
        default=25.0, metadata=_help("on SIGTERM, how long open streams may finish before the server stops")
    )
    record_ttl_s: float = field(default=60.0, metadata=_help("how long Redis keeps a finished request's record"))
    api_key_file: str = field(
        default="", metadata=_help("API keys, one per line (# comments); with $PDSERVE_API_KEYS (comma-separated): "
                                   "the gRPC API and HTTP routes but /healthz, /readyz, /metrics need one")
    )
    jwt_secret_file: str = field(default="", metadata=_help("accept JWTs signed HS256 with the secret in this file"))
    jwt_public_key_file: str = field(
        default="", metadata=_help("accept JWTs signed RS256/ES256 with the PEM public key in this file")
    )
    jwt_issuer: str = field(default="", metadata=_help("JWTs must have this 'iss' (default: not checked)"))
    jwt_audience: str = field(default="", metadata=_help("JWTs must have this 'aud' (default: not checked)"))
    rate_limit_requests_per_min: int = field(
        default=0, metadata=_help("requests each caller (API key, JWT subject; all callers as one without auth) may "
                                  "send per minute, shared by every router through Redis (0: no limit)")
    )
    rate_limit_tokens_per_min: int = field(
        default=0, metadata=_help("tokens each caller may use per minute: prompt + max_tokens reserved at "
                                  "admission, the ungenerated part given back at the end (0: no limit)")
    )
    rate_limit_file: str = field(
        default="", metadata=_help("YAML of per-caller budgets, principal -> {requests_per_min, tokens_per_min}, "
                                   "overriding the two flags for those callers")
    )
    tls_cert_file: str = field(
        default="", metadata=_help("mutual TLS to the workers: the router's PEM certificate, presented on its calls "
                                   "to them (needs --tls-key-file and --tls-ca-file; default: plaintext)")
    )
    tls_key_file: str = field(default="", metadata=_help("mutual TLS: the certificate's PEM private key (unencrypted)"))
    tls_ca_file: str = field(
        default="", metadata=_help("mutual TLS: PEM bundle of the CA that signs every service's certificate; the "
                                   "router trusts only workers whose certificate it signed")
    )
    tls_server_name: str = field(
        default="", metadata=_help("mutual TLS: name the workers' certificates must carry, checked instead of the "
                                   "host dialled (for workers advertised by IP address; default: that host)")
    )
    public_tls_cert_file: str = field(
        default="", metadata=_help("TLS on the public gRPC API: PEM certificate (with --public-tls-key-file; clients "
                                   "need no certificate; default: plaintext). The HTTP front stays plaintext")
    )
    public_tls_key_file: str = field(
        default="", metadata=_help("TLS on the public gRPC API: the certificate's PEM private key (unencrypted)")
    )
    k8s_prefill_service: str = field(
        default="", metadata=_help("Kubernetes discovery: headless Service of the prefill pods; a registry worker "
                                   "whose pod its EndpointSlices show not ready or terminating gets no new "
                                   "requests (empty: not watched)")
    )
    k8s_decode_service: str = field(
        default="", metadata=_help("Kubernetes discovery: headless Service of the decode pods (as "
                                   "--k8s-prefill-service; empty: not watched)")
    )
    k8s_namespace: str = field(
        default="", metadata=_help("Kubernetes discovery: namespace of those Services (default: the router pod's "
                                   "own, else the kubeconfig context's, else default)")
    )
    k8s_kubeconfig: str = field(
        default="", metadata=_help("Kubernetes discovery: kubeconfig file (default: the pod's service account in a "
                                   "pod, else $KUBECONFIG or ~/.kube/config)")
    )
    k8s_refresh_s: float = field(default=2.0, metadata=_help("Kubernetes discovery: how often the EndpointSlices "
                                                             "are listed"))
