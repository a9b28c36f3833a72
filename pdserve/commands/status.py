"""``pdserve status``: the live workers in the Redis registry, their role, address, load and KV blocks.

With ``--json`` stdout carries only one compact JSON object, ``{"workers": [...]}``: one object per live
worker, sorted by role then id, each holding every :class:`common.state.registry.WorkerInfo` field. The
keys ``id, role, address, host, pid, num_requests_running, num_requests_waiting, kv_blocks_used,
kv_blocks_total`` are always present (scripts rely on them); later versions may add keys, never drop
them. Without ``--json``: a table for people.

With ``--k8s`` (:mod:`pdserve.commands.status_k8s`) it also shows the prefill and decode pools as Kubernetes
sees them: EndpointSlice endpoints and workload replicas. The registry is then read only when ``--redis-url``
or ``$PDSERVE_REDIS_URL`` gives it (and merged: which pods are registered); ``--json`` prints
``{"workers": [...], "k8s": {...}}`` (``workers`` only when the registry was read; the ``k8s`` shape is in
that module's docstring). Without ``--k8s`` output and ``--json`` shape are as above.

Exit status 0; 1 if Redis cannot be reached (one line on stderr naming the URL, within about 2 s), or, with
``--k8s``, if no Kubernetes configuration is usable or an EndpointSlice list fails (one line naming it).
Imports only the state package (redis), and that inside :func:`status`, so the command starts fast; the
``kubernetes`` package only with ``--k8s``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

from pdserve.commands import status_k8s

if TYPE_CHECKING:
    from common.state.registry import WorkerInfo

REDIS_URL_ENV = "PDSERVE_REDIS_URL"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "pdserve:"  # = common.state.keys.DEFAULT_PREFIX, not imported so --help stays fast
REDIS_TIMEOUT_S = 1.0  # per connect and per command; with one retry an unreachable Redis fails in ~2 s
_TABLE_COLUMNS = ("ROLE", "ID", "ADDRESS", "RUNNING", "WAITING", "KV USED/TOTAL", "CACHED", "STATE", "HEARTBEAT")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("status", help="list the live workers in the Redis registry and their load")
    p.add_argument(
        "--redis-url",
        default=None,
        help=f"the cluster's Redis (default: ${REDIS_URL_ENV}, else {DEFAULT_REDIS_URL})",
    )
    p.add_argument(
        "--prefix", default=DEFAULT_PREFIX, help=f"Redis key prefix of the cluster (default {DEFAULT_PREFIX})"
    )
    p.add_argument("--json", action="store_true", help='print only {"workers": [...]} as compact JSON on stdout')
    status_k8s.add_arguments(p)
    p.set_defaults(func=status)


def redis_url_from(args: argparse.Namespace) -> str:
    """``--redis-url``, else ``$PDSERVE_REDIS_URL``, else the local default."""
    return args.redis_url or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


def status(args: argparse.Namespace) -> int:
    from common.state.redis_client import redact_url

    url = redis_url_from(args)
    workers = None
    if not args.k8s or args.redis_url or os.environ.get(REDIS_URL_ENV):
        workers = read_registry(url, args.prefix)
        if workers is None:
            return 1
    if args.k8s:
        return status_with_k8s(args, workers)
    if args.json:
        print(json.dumps({"workers": [w.to_dict() for w in workers]}, separators=(",", ":")))
    else:
        print(format_table(workers, now_s=time.time()))
        if not workers:
            print(f"no live workers under prefix {args.prefix!r} at {redact_url(url)}")
    return 0


def read_registry(url: str, prefix: str) -> list[WorkerInfo] | None:
    """The live workers sorted by role then id; None (and one error line on stderr) if Redis did not answer."""
    import redis

    from common.state.redis_client import connect, describe_error
    from common.state.registry import WorkerRegistry

    client = connect(url, socket_timeout_s=REDIS_TIMEOUT_S, socket_connect_timeout_s=REDIS_TIMEOUT_S)
    try:
        workers = WorkerRegistry(client, prefix=prefix).list_workers()
    except redis.RedisError as e:
        message = f"cannot read the worker registry from {describe_error(e, url)}"
        print(f"pdserve status: error: {message}", file=sys.stderr)
        return None
    finally:
        client.close()
    return sorted(workers, key=lambda w: (w.role, w.id))


def status_with_k8s(args: argparse.Namespace, workers: list[WorkerInfo] | None) -> int:
    """``--k8s``: the pools from the Kubernetes API, after the registry table when ``workers`` were read."""
    from common.cluster.k8s import K8sError

    try:
        reader = status_k8s.connect(args)
    except K8sError as e:
        print(f"pdserve status: error: {e}", file=sys.stderr)
        return 1
    try:
        pools = status_k8s.read_pools(reader, args, workers)
    except K8sError as e:
        print(f"pdserve status: error: {e}", file=sys.stderr)
        return 1
    finally:
        reader.close()
    if args.json:
        shown = {"workers": [w.to_dict() for w in workers]} if workers is not None else {}
        print(json.dumps({**shown, "k8s": status_k8s.to_json(reader, pools)}, separators=(",", ":")))
        return 0
    if workers is not None:
        print(format_table(workers, now_s=time.time()))
        print()
    print(status_k8s.format_pools(reader, pools))
    return 0


def format_table(workers: list[WorkerInfo], *, now_s: float) -> str:
    """The workers as an aligned text table; HEARTBEAT is the age of each worker's last load report."""
    rows = [_TABLE_COLUMNS]
    for w in workers:
        rows.append(
            (
                w.role,
                w.id,
                w.address,
                str(w.num_requests_running),
                str(w.num_requests_waiting),
                f"{w.kv_blocks_used}/{w.kv_blocks_total}",
                str(w.kv_blocks_cached),
                w.state,
                f"{max(0.0, now_s - w.updated_at):.1f}s ago",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(_TABLE_COLUMNS))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
