"""``pdserve trace REQUEST_ID``: one request's path through the cluster, stage by stage, from its record in Redis.

Stages (unix times written by the router, the prefill worker's reported by it through the router):
received → routed (KV reserved on decode) → queued (prefill worker's engine) → prefill start → KV transfer
start → prefill end (first token sampled) → KV transfer end (decode acknowledged) → first token (sent to the
client) → decode start → last token → finished. KV transfer starts before prefill ends: each layer's KV
leaves as soon as it is computed, and the trace shows how much of the transfer was left after compute.
Times on different hosts depend on their clocks being in sync (NTP).

With ``--json`` stdout carries one compact object: the record's fields, plus ``stages``, a list of
``{"stage", "at", "offset_ms", "delta_ms"}`` (offset from received; delta from the previous stage present).
A record lives while its request runs and ``--record-ttl-s`` (router, default 60 s) after it finished.
Exit status 0; 1 if there is no such record or Redis cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdserve.commands.status import DEFAULT_PREFIX, REDIS_TIMEOUT_S, redis_url_from

# (stage, record field), in the order a request goes through them.
STAGES = (
    ("received", "created_at"),
    ("routed", "routed_at"),
    ("queued", "queued_at"),
    ("prefill_start", "prefill_started_at"),
    ("kv_transfer_start", "kv_transfer_started_at"),
    ("prefill_end", "prefill_finished_at"),
    ("kv_transfer_end", "kv_transfer_finished_at"),
    ("first_token", "first_token_at"),
    ("decode_start", "decode_started_at"),
    ("last_token", "last_token_at"),
)
_TERMINAL = ("finished", "failed", "aborted")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("trace", help="show one request's stages (received ... last token) from Redis")
    p.add_argument("request_id", help="the request id (GenerateResponse.request_id, `pdserve generate --json`)")
    p.add_argument("--redis-url", default=None, help="the cluster's Redis (default: $PDSERVE_REDIS_URL, else local)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"Redis key prefix (default {DEFAULT_PREFIX})")
    p.add_argument("--json", action="store_true", help="print one compact JSON object on stdout")
    p.set_defaults(func=trace)


def stages_of(record: dict) -> list[dict]:
    """The stages present in ``record`` (a RequestRecord as a dict), in pipeline order, with offsets."""
    start = record["created_at"]
    out, previous = [], start
    rows = list(STAGES)
    if record["status"] in _TERMINAL:
        rows.append(("finished", "updated_at"))
    for stage, field_name in rows:
        at = record.get(field_name) or 0.0
        if not at:
            continue
        out.append({"stage": stage, "at": at, "offset_ms": round((at - start) * 1e3, 3),
                    "delta_ms": round((at - previous) * 1e3, 3)})
        previous = at
    return out


def trace(args: argparse.Namespace) -> int:
    import dataclasses

    import redis

    from common.state.records import RequestStore
    from common.state.redis_client import connect, redact_url

    url = redis_url_from(args)
    client = connect(url, socket_timeout_s=REDIS_TIMEOUT_S, socket_connect_timeout_s=REDIS_TIMEOUT_S)
    try:
        record = RequestStore(client, prefix=args.prefix).get(args.request_id)
    except redis.RedisError as e:
        print(f"pdserve trace: error: cannot read from Redis at {redact_url(url)}: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if record is None:
        print(f"pdserve trace: no record of request {args.request_id!r} at {redact_url(url)} (unknown, or "
              "expired: records live --record-ttl-s after the request ends)", file=sys.stderr)
        return 1
    fields = dataclasses.asdict(record)
    stages = stages_of(fields)
    if args.json:
        print(json.dumps({**fields, "stages": stages}, separators=(",", ":")))
        return 0
    print(f"request {record.request_id}: {record.status}"
          + (f" ({record.finish_reason})" if record.finish_reason else "")
          + (f", error: {record.error}" if record.error else ""))
    print(f"prefill {record.prefill_worker_id or '-'} -> decode {record.decode_worker_id or '-'}; "
          f"{record.num_prompt_tokens} prompt tokens, {record.num_tokens_emitted} emitted")
    if record.route_reason:
        print(f"routed because: {record.route_reason}")
    if record.trace_id:
        print(f"trace id: {record.trace_id}")
    width = max(len(s["stage"]) for s in stages)
    for s in stages:
        print(f"  {s['stage'].ljust(width)}  +{s['offset_ms']:10.1f} ms  (+{s['delta_ms']:.1f} ms)")
    return 0
