"""Entry point of a decode worker: ``pdserve decode ...``."""

from __future__ import annotations

import os
import shutil
import tempfile

from common.engine.engine_loop import EngineLoop
from common.engine.identity import ModelIdentity
from common.kv_transfer import nixl, nixl_blocks
from common.kv_transfer.shm import ShmKVReceiver
from services.decode.servicer import SERVICE_NAME, DecodeServicer, add_to_server
from services.worker.config import WorkerConfig
from services.worker.runtime import WorkerObs, WorkerParts, serve_worker


def make_parts(config: WorkerConfig):
    if config.kv_nixl and (why := nixl.setup_error()):
        raise SystemExit(f"--kv-nixl: {why}")

    def make(loop: EngineLoop, identity: ModelIdentity, obs: WorkerObs) -> WorkerParts:
        own_dir = not config.kv_shm_dir
        shm_dir = tempfile.mkdtemp(prefix="pdserve-kv-") if own_dir else config.kv_shm_dir  # 0700 when made here
        if config.kv_shm:
            os.makedirs(shm_dir, mode=0o700, exist_ok=True)
        shm = ShmKVReceiver(os.path.join(shm_dir, f"kv-{os.getpid()}.sock")) if config.kv_shm else None
        nixl_receiver = None
        if config.kv_nixl:  # direct block writes into the cache, unless it holds a share of the heads per rank
            direct = loop.engine.tensor_parallel is None and nixl_blocks.blocks_enabled()
            on_bytes = obs.metrics.count_kv_received if obs.metrics is not None else None
            nixl_receiver = nixl.NixlKVReceiver(kv_cache=loop.engine.kv_cache if direct else None,
                                                on_block_bytes=on_bytes)  # fmt: skip

        def stop() -> None:
            servicer.close()
            if shm is not None:
                shm.close()  # removes the socket
            if nixl_receiver is not None:
                nixl_receiver.close()
            if own_dir:
                shutil.rmtree(shm_dir, ignore_errors=True)

        servicer = DecodeServicer(
            loop,
            identity,
            generation_config=loop.engine.loaded.generation_config,
            default_max_tokens=config.default_max_tokens,
            max_lease_s=config.kv_lease_s,
            stream_interval=config.stream_interval,
            shm_receiver=shm,
            nixl_receiver=nixl_receiver,
            metrics=obs.metrics,
            tracing=obs.tracing,
            max_pending_requests=config.max_pending_requests,
            draining=obs.draining,
        )

        def details() -> dict:
            stats = loop.stats
            return {"kv_cache_usage": round(stats.kv_blocks_used / max(1, stats.kv_blocks_total), 4),
                    "kv_blocks_used": stats.kv_blocks_used, "kv_blocks_total": stats.kv_blocks_total,
                    "kv_reservations": servicer.num_reservations, "kv_reservations_held": servicer.num_held}

        return WorkerParts(
            add_to_server=lambda server: add_to_server(servicer, server),
            service_names=[SERVICE_NAME],
            tick=servicer.expire_leases,
            num_inflight=lambda: servicer.num_reservations,
            on_stop=stop,
            details=details,
            use_asyncio=True,  # Decode streams are async generators (see DecodeServicer.Decode)
        )

    return make


def run(config: WorkerConfig, **kwargs) -> int:
    return serve_worker("decode", config, make_parts(config), **kwargs)
