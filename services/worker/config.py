"""Settings of a prefill or decode worker (flags, ``PDSERVE_*`` environment variables, ``--config`` YAML)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.quantization import QUANTIZATION_METHODS


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class WorkerConfig:
    model: str = field(default="", metadata=_help("local Hugging Face model directory (required)"))
    allow_pickle_weights: bool = field(
        default=False,
        metadata=_help("load a model directory that has only pickle weights (*.bin): UNSAFE, unpickling a file "
                       "can run code at load; use only for checkpoints you trust, prefer converting to safetensors"),
    )
    dtype: str = field(default="auto", metadata=_help("float32 | bfloat16 | float16 | auto"))
    device: str = field(default="cpu", metadata=_help("cpu | cuda | cuda:N"))
    quantization: str = field(
        default="none",
        metadata={"help": "int8 quantization of the linear layers: int8-weight-only or int8-dynamic (W8A8), "
                          "both need torchao (pip install 'pdserve[quant]'); prefill and decode workers must use "
                          "the same",
                  "choices": list(QUANTIZATION_METHODS)},
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=_help("torch.distributed tensor parallelism over N processes of this host (gloo on the CPU, NCCL on "
                       "CUDA); prefill and decode pools may use different sizes"),
    )
    host: str = field(default="127.0.0.1", metadata=_help("address to listen on"))
    port: int = field(default=0, metadata=_help("gRPC port (0: any free port)"))
    metrics_port: int = field(default=0, metadata=_help("HTTP port of /metrics, /healthz, /readyz (0: any free port)"))
    advertise_host: str = field(default="", metadata=_help("host others reach this worker at (default: --host)"))
    worker_id: str = field(default="", metadata=_help("registry id (default: ROLE-HOSTNAME-PID)"))
    redis_url: str = field(default="redis://127.0.0.1:6379/0", metadata=_help("Redis holding the registry"))
    redis_prefix: str = field(default="pdserve:", metadata=_help("prefix of every Redis key"))
    heartbeat_ttl_s: float = field(default=10.0, metadata=_help("registry entry lifetime without heartbeat"))
    kv_cache_memory: float | None = field(default=None, metadata=_help("KV bytes (> 1) or free-memory fraction"))
    block_size: int = field(default=16, metadata=_help("tokens per KV block"))
    max_num_seqs: int = field(default=64, metadata=_help("most requests in the running batch"))
    max_pending_requests: int = field(
        default=256, metadata=_help("most requests held (running, queued or awaiting KV); more: RESOURCE_EXHAUSTED")
    )
    max_model_len: int | None = field(default=None, metadata=_help("context length (default: the model's)"))
    max_num_batched_tokens: int = field(default=2048, metadata=_help("token budget of one engine step"))
    prefill_chunk_size: int | None = field(default=None, metadata=_help("most prompt tokens per request per step"))
    prefix_caching: bool = field(default=True, metadata=_help("reuse the KV of cached prompt prefixes"))
    cuda_graphs: bool = field(
        default=False, metadata=_help("CUDA: replay decode steps from CUDA graphs, one per batch and context bucket")
    )
    prefix_cache_ttl_s: float = field(
        default=0.0, metadata=_help("forget cached prefix blocks (a session's KV) unused this long (0: LRU only)")
    )
    kv_block_placement: str = field(
        default="auto",
        metadata={"help": "which free KV blocks a request gets: contiguous (stretches of consecutive blocks: fewer, "
                          "longer NIXL block writes, but a decode worker keeps less of its recent sessions' KV), lru "
                          "(the least recently freed), or auto (contiguous where KV moves by NIXL block writes, else "
                          "lru)",
                  "choices": ["auto", "contiguous", "lru"]},
    )
    weight_layout: str = field(
        default="auto",
        metadata={"help": "what the CPU weight layouts are chosen for: decode (steps of a few rows: the engine's own "
                          "kernels), prefill (batches of prompt tokens: oneDNN's GEMM layout for bf16 on AMX CPUs, "
                          "8-10% faster prefill, slower decode steps), or auto (prefill on a prefill worker, else "
                          "decode)",
                  "choices": ["auto", "decode", "prefill"]},
    )
    prefill_attention: str = field(
        default="auto",
        metadata={"help": "how prefill steps attend on the CPU: kernel (the engine's flash attention, bf16 on "
                          "AVX512-BF16 CPUs, on AMX tiles where the CPU has them, fp32 on AVX-512, both in float on "
                          "AVX2 CPUs: on a Zen 4 VM a 2,048-token bf16 prefill 1.3x faster, a 4,000-token prompt in "
                          "chunks 1.5x; on a Zen 3 VM 1.13x and 1.19x), sdpa "
                          "(torch's), or auto (the kernel where built, except bf16 on AMX CPUs for head dims the "
                          "AMX path does not cover: past 128 or not a multiple of 32)",
                  "choices": ["auto", "kernel", "sdpa"]},
    )
    kv_host_cache_blocks: int = field(
        default=0, metadata=_help("prefix cache spill tier: evicted blocks kept in host memory (0: off)")
    )
    kv_shared_cache_blocks: int = field(
        default=0, metadata=_help("prefix cache shared tier: most blocks kept in Redis for every worker (0: off)")
    )
    kv_shared_cache_ttl_s: float = field(default=600.0, metadata=_help("lifetime of a block in the shared tier"))
    kv_encryption_key_file: str = field(
        default="",
        metadata=_help("file of the AES-256-GCM key (32 raw bytes, 64 hex digits or base64) that encrypts and "
                       "authenticates KV blocks written outside the process (the shared tier); empty: plaintext"),
    )
    warmup_file: str = field(default="", metadata=_help("JSONL of prefixes to compute and pin at start"))
    threads: int | None = field(default=None, metadata=_help("torch CPU threads"))
    default_max_tokens: int = field(default=64, metadata=_help("max_tokens when a request gives none"))
    kv_lease_s: float = field(default=30.0, metadata=_help("decode: longest KV reservation lease"))
    stream_interval: int = field(
        default=1, metadata=_help("decode: tokens per streamed message after the first, each held back at most "
                                  "0.1 s (1: every token as it comes; more: fewer messages, less CPU per token)")
    )
    kv_transfer_timeout_s: float = field(default=30.0, metadata=_help("prefill: longest wait for KV acknowledgement"))
    kv_write_stall_s: float = field(
        default=10.0,
        metadata=_help("prefill, NIXL: a decode worker silent this long (plus 1 s per MiB of writes outstanding) while "
                       "a KV grant, write or confirmation is awaited ends the channel and fails its transfers for a "
                       "retry (a lost link; gRPC transfers have keepalive pings); 0: only --kv-transfer-timeout-s"),
    )
    kv_chunk_bytes: int = field(default=4 << 20, metadata=_help("prefill: largest KV chunk on the wire"))
    kv_transport: str = field(
        default="grpc",
        metadata={"help": "prefill: grpc, shm (shared memory to decode workers on the same host, else grpc), or nixl "
                          "(NIXL writes to decode workers that offer it, on any host, else grpc)",
                  "choices": ["grpc", "shm", "nixl"]},
    )
    kv_shm: bool = field(default=True, metadata=_help("decode: also take KV through shared memory on this host"))
    kv_nixl: bool = field(
        default=False, metadata=_help("decode: also take KV by NIXL writes, from any host (needs pdserve[nixl])")
    )
    kv_shm_dir: str = field(default="", metadata=_help("decode: folder of its shm KV socket (default: a temp dir)"))
    otlp_endpoint: str = field(
        default="", metadata=_help("OTLP gRPC endpoint of traces (default: $OTEL_EXPORTER_OTLP_ENDPOINT)")
    )
    drain_timeout_s: float = field(default=30.0, metadata=_help("on SIGTERM, how long in-flight requests may finish"))
    api_key_file: str = field(
        default="", metadata=_help("API keys, one per line (# comments); with $PDSERVE_API_KEYS (comma-separated): "
                                   "POST /admin/warmup needs one (gRPC, /metrics, /healthz, /readyz stay open)")
    )
    jwt_secret_file: str = field(default="", metadata=_help("accept JWTs signed HS256 with the secret in this file"))
    jwt_public_key_file: str = field(
        default="", metadata=_help("accept JWTs signed RS256/ES256 with the PEM public key in this file")
    )
    jwt_issuer: str = field(default="", metadata=_help("JWTs must have this 'iss' (default: not checked)"))
    jwt_audience: str = field(default="", metadata=_help("JWTs must have this 'aud' (default: not checked)"))
    tls_cert_file: str = field(
        default="", metadata=_help("mutual TLS between services: this service's PEM certificate, presented as server "
                                   "and as client (needs --tls-key-file and --tls-ca-file; default: plaintext)")
    )
    tls_key_file: str = field(default="", metadata=_help("mutual TLS: the certificate's PEM private key (unencrypted)"))
    tls_ca_file: str = field(
        default="", metadata=_help("mutual TLS: PEM bundle of the CA that signs every service's certificate; "
                                   "the gRPC port then refuses peers without a certificate signed by it")
    )
    tls_server_name: str = field(
        default="", metadata=_help("mutual TLS: name the workers' certificates must carry, checked instead of the "
                                   "host dialled (for workers advertised by IP address; default: that host)")
    )
    test_corrupt_kv_chunk: int | None = field(
        default=None, metadata=_help("TEST ONLY: prefill flips a byte of this KV chunk (seq) of every request")
    )
    test_stall_kv_chunk: int | None = field(
        default=None, metadata=_help("TEST ONLY: prefill's KV stream of every request stops at this chunk (seq)")
    )
