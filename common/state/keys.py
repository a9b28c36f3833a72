"""The Redis key schema: every key pdserve reads or writes is built here, and nowhere else.

All keys live under one prefix (default ``pdserve:``; a deployment or a test may choose another, e.g.
``pdserve-test-3:``, to share one Redis). Ids are opaque non-empty strings without whitespace.

=================================  =====  ==========================================  ======================
Key                                Type   TTL                                         Owner (writer) → readers
=================================  =====  ==========================================  ======================
``{prefix}worker:{worker_id}``     hash   ``ttl_s`` of the registry (default 10 s),   the worker (heartbeat)
                                          restarted by every heartbeat (PEXPIRE)      → router, status
``{prefix}workers:{role}``         set    none: members whose worker hash is gone     the worker adds;
                                          are removed lazily by ``list_workers``      listers remove dead
``{prefix}request:{request_id}``   hash   ``ttl_s`` while active (default 3600 s),    the router
                                          ``finished_ttl_s`` once finished (60 s)     → status, operators
``{prefix}session:{session_id}``   hash   ``ttl_s`` (default 1800 s), restarted by    the router
                                          every ``put`` and ``append_tokens``         → the router
``{prefix}prefix:{worker_id}``     set    the registry's ``ttl_s``, restarted by      the worker
                                          every publish                              → the router
``{prefix}ratelimit:{principal}``  hash   until its budgets are full again (at most   the routers
                                          a minute), set by every charge             → the routers
=================================  =====  ==========================================  ======================

Field layouts (all field values are byte strings; the codecs live in :mod:`common.state.records`):

- worker hash: the fields of :class:`common.state.registry.WorkerInfo`, one hash field each.
- ``workers:{role}``: a listing aid only. Liveness is the worker hash alone (its TTL is kept by the Redis
  clock, so no host clocks are compared); ``role`` is ``prefill`` or ``decode``.
- request hash: the fields of :class:`common.state.records.RequestRecord`, one hash field each;
  ``deadline_s`` is ``""`` when absent. Integers are decimal (so ``HINCRBY`` works), floats ``repr``.
- session hash: ``session_id``, ``decode_worker_id``, ``updated_at`` and ``token_ids``, the conversation's
  token ids packed as little-endian uint32 (4 bytes per token, appended atomically in a Lua script).
- ``prefix:{worker_id}``: the names (16 raw bytes each, :mod:`common.engine.prefix_cache`) of the KV blocks
  the worker's prefix cache holds, in use or cached; the router's prefix index.
- ``ratelimit:{principal}``: one caller's rate-limit state (:mod:`common.state.rate_limit`), fields
  ``requests_tat_ms`` and ``tokens_tat_ms``, each the theoretical arrival time of its GCRA budget in Redis-clock
  unix milliseconds (a float). ``principal`` is the caller (``key:<12 hex>``, a JWT ``sub``, or ``anonymous``)
  percent-encoded, so any ``sub`` makes a key without whitespace.
"""

from __future__ import annotations

from urllib.parse import quote

DEFAULT_PREFIX = "pdserve:"


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a usable key prefix (non-empty, ends with ``:``), else ValueError."""
    if not isinstance(prefix, str) or not prefix.endswith(":") or any(c.isspace() for c in prefix):
        raise ValueError(f"Redis key prefix must end with ':' and hold no whitespace, got {prefix!r}")
    return prefix


def _check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise ValueError(f"{kind} must be a non-empty string without whitespace, got {value!r}")
    return value


def worker_key(worker_id: str, *, prefix: str = DEFAULT_PREFIX) -> str:
    """Hash of one live worker's :class:`WorkerInfo`; expires unless heartbeats refresh it."""
    return f"{check_prefix(prefix)}worker:{_check_id('worker_id', worker_id)}"


def workers_index_key(role: str, *, prefix: str = DEFAULT_PREFIX) -> str:
    """Set of the worker ids of one role; may hold ids whose worker hash has expired (cleaned lazily)."""
    return f"{check_prefix(prefix)}workers:{_check_id('role', role)}"


def registry_epoch_key(*, prefix: str = DEFAULT_PREFIX) -> str:
    """String naming this Redis's registry epoch (a random id, no TTL): it changes when Redis restarts empty or
    is flushed, which tells a router that the workers missing from the registry are re-registering."""
    return f"{check_prefix(prefix)}registry:epoch"


def request_key(request_id: str, *, prefix: str = DEFAULT_PREFIX) -> str:
    """Hash of one request's :class:`RequestRecord`."""
    return f"{check_prefix(prefix)}request:{_check_id('request_id', request_id)}"


def session_key(session_id: str, *, prefix: str = DEFAULT_PREFIX) -> str:
    """Hash of one conversation's :class:`SessionRecord`."""
    return f"{check_prefix(prefix)}session:{_check_id('session_id', session_id)}"


def prefix_index_key(worker_id: str, *, prefix: str = DEFAULT_PREFIX) -> str:
    """Set of the block names one worker's prefix cache holds."""
    return f"{check_prefix(prefix)}prefix:{_check_id('worker_id', worker_id)}"


def rate_limit_key(principal: str, *, prefix: str = DEFAULT_PREFIX) -> str:
    """Hash of one caller's rate-limit budgets; gone once they are full again. ``principal``: any non-empty
    string (percent-encoded here, ``:`` kept: ``key:0123456789ab`` stays readable)."""
    if not isinstance(principal, str) or not principal:
        raise ValueError(f"principal must be a non-empty string, got {principal!r}")
    return f"{check_prefix(prefix)}ratelimit:{quote(principal, safe=':')}"
