"""Entry point of a decode worker: ``pdserve decode ...``."""

from __future__ import annotations

from common.engine.engine_loop import EngineLoop
from common.engine.identity import ModelIdentity
from services.decode.servicer import SERVICE_NAME, DecodeServicer, add_to_server
from services.worker.config import WorkerConfig
from services.worker.runtime import WorkerParts, serve_worker


def make_parts(config: WorkerConfig):
    def make(loop: EngineLoop, identity: ModelIdentity) -> WorkerParts:
        servicer = DecodeServicer(
            loop,
            identity,
            generation_config=loop.engine.loaded.generation_config,
            default_max_tokens=config.default_max_tokens,
            max_lease_s=config.kv_lease_s,
        )
        return WorkerParts(
            add_to_server=lambda server: add_to_server(servicer, server),
            service_names=[SERVICE_NAME],
            tick=servicer.expire_leases,
            num_inflight=lambda: servicer.num_reservations,
        )

    return make


def run(config: WorkerConfig, **kwargs) -> int:
    return serve_worker("decode", config, make_parts(config), **kwargs)
