"""Entry point of a prefill worker: ``pdserve prefill ...``."""

from __future__ import annotations

from common.engine.engine_loop import EngineLoop
from common.engine.identity import ModelIdentity
from common.kv_transfer import nixl
from common.rpc.tls import TlsFiles
from pdserve.v1 import worker_pb2_grpc
from services.prefill.servicer import PrefillServicer
from services.worker.config import WorkerConfig
from services.worker.runtime import WorkerObs, WorkerParts, serve_worker

SERVICE_NAME = "pdserve.v1.PrefillService"


def make_parts(config: WorkerConfig):
    if not config.kv_write_stall_s >= 0:  # (NaN included)
        raise SystemExit(f"--kv-write-stall-s must be >= 0 (0: no watch), got {config.kv_write_stall_s!r}")
    kv_tls = TlsFiles.from_config(config)  # the KV channels to decode workers present this worker's certificate
    if config.kv_transport == "nixl":  # a bad setting fails the start, not each channel (no NIXL: gRPC, logged)
        if why := nixl.settings_error():
            raise SystemExit(f"--kv-transport nixl: {why}")

    def make(loop: EngineLoop, identity: ModelIdentity, obs: WorkerObs) -> WorkerParts:
        servicer = PrefillServicer(
            loop,
            identity,
            generation_config=loop.engine.loaded.generation_config,
            default_max_tokens=config.default_max_tokens,
            transfer_timeout_s=config.kv_transfer_timeout_s,
            write_stall_s=config.kv_write_stall_s,
            chunk_bytes=config.kv_chunk_bytes,
            corrupt_chunk_seq=config.test_corrupt_kv_chunk,
            stall_chunk_seq=config.test_stall_kv_chunk,
            kv_transport=config.kv_transport,
            metrics=obs.metrics,
            tracing=obs.tracing,
            max_pending_requests=config.max_pending_requests,
            draining=obs.draining,
            kv_tls=kv_tls,
        )
        return WorkerParts(
            add_to_server=lambda server: worker_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, server),
            service_names=[SERVICE_NAME],
            num_inflight=lambda: servicer.num_inflight,
            on_stop=servicer.close,
            details=lambda: {"queue": loop.stats.num_requests_waiting, "kv_transfers_in_flight": servicer.num_inflight},
        )

    return make


def run(config: WorkerConfig, **kwargs) -> int:
    return serve_worker("prefill", config, make_parts(config), **kwargs)
