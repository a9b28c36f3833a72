"""``pdserve router|prefill|decode``: run one service, configured by flags, ``PDSERVE_*`` environment
variables and an optional ``--config`` YAML file (precedence flag > environment > file > default)."""

from __future__ import annotations

import argparse
import logging

from common.config.loader import add_config_args, resolve_config
from common.malloc import tune_malloc
from services.router.config import RouterConfig
from services.worker.config import WorkerConfig

log = logging.getLogger(__name__)

_SERVICES = {
    "router": (RouterConfig, "the router: public gRPC API, picks workers, relays streams"),
    "prefill": (WorkerConfig, "a prefill worker: prompts to first token, KV streamed to decode"),
    "decode": (WorkerConfig, "a decode worker: holds KV, decodes with continuous batching"),
}


def add_parser(subparsers) -> None:
    for role, (schema, help_text) in _SERVICES.items():
        p = subparsers.add_parser(role, help=help_text)
        add_config_args(p, schema)
        p.set_defaults(func=lambda args, role=role: run_service(role, args))


def run_service(role: str, args: argparse.Namespace) -> int:
    schema = _SERVICES[role][0]
    resolved = resolve_config(schema, args)
    log.info("%s settings: %s", role, resolved.describe())
    tune_malloc()  # this process is the service: its large gRPC buffers stay on the heap
    if role == "router":
        from services.router.main import run
    elif role == "prefill":
        from services.prefill.main import run
    else:
        from services.decode.main import run
    return run(resolved.config)
