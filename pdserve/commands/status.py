"""``pdserve status``: the live workers in the Redis registry, their role, address, load and KV blocks.

With ``--json`` stdout carries only one compact JSON object, ``{"workers": [...]}``: one object per live
worker, sorted by role then id, each holding every :class:`common.state.registry.WorkerInfo` field. The
keys ``id, role, address, host, pid, num_requests_running, num_requests_waiting, kv_blocks_used,
kv_blocks_total`` are always present (scripts rely on them); later versions may add keys, never drop
them. Without ``--json``: a table for people.

Exit status 0; 1 if Redis cannot be reached (one line on stderr naming the URL, within about 2 s).
Imports only the state package (redis), and that inside :func:`status`, so the command starts fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

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
    p.set_defaults(func=status)


def redis_url_from(args: argparse.Namespace) -> str:
    """``--redis-url``, else ``$PDSERVE_REDIS_URL``, else the local default."""
    return args.redis_url or os.environ.get(REDIS_URL_ENV) or DEFAULT_REDIS_URL


def status(args: argparse.Namespace) -> int:
    import redis

    from common.state.redis_client import connect, describe_error, redact_url
    from common.state.registry import WorkerRegistry

    url = redis_url_from(args)
    client = connect(url, socket_timeout_s=REDIS_TIMEOUT_S, socket_connect_timeout_s=REDIS_TIMEOUT_S)
    try:
        workers = WorkerRegistry(client, prefix=args.prefix).list_workers()
    except redis.RedisError as e:
        message = f"cannot read the worker registry from {describe_error(e, url)}"
        print(f"pdserve status: error: {message}", file=sys.stderr)
        return 1
    finally:
        client.close()
    workers.sort(key=lambda w: (w.role, w.id))
    if args.json:
        print(json.dumps({"workers": [w.to_dict() for w in workers]}, separators=(",", ":")))
    else:
        print(format_table(workers, now_s=time.time()))
        if not workers:
            print(f"no live workers under prefix {args.prefix!r} at {redact_url(url)}")
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
