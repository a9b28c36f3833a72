"""The worker registry: which prefill and decode workers are alive, where they listen, how loaded they are.

Who calls what:

- each worker: :meth:`WorkerRegistry.register` once at start-up, then a :class:`Heartbeater` thread that
  calls :meth:`WorkerRegistry.heartbeat` every ``interval_s`` (<= 1 s) with fresh load, and
  :meth:`WorkerRegistry.deregister` at shutdown (after ``Heartbeater.stop()``, or the next beat
  re-creates the entry).
- the router and ``pdserve status``: :meth:`WorkerRegistry.list_workers` and :meth:`WorkerRegistry.get`.

Liveness is the worker hash's TTL (``ttl_s``, default 10 s, kept by Redis's clock): a worker that stops
heartbeating (SIGKILL, hang, network split) vanishes from ``list_workers`` within ``ttl_s``, with nobody
having to clean up. The per-role index set is only a listing aid; its dead members are removed lazily,
atomically (a Lua script re-checks the hash), by whoever lists.

Every method blocks for one or two Redis round trips and raises ``redis.RedisError`` when Redis is
unreachable; only :class:`Heartbeater` absorbs those errors.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from common.state.keys import DEFAULT_PREFIX, check_prefix, registry_epoch_key, worker_key, workers_index_key
from common.state.records import decode_fields, encode_fields, ttl_ms

logger = logging.getLogger(__name__)

WORKER_ROLES = ("prefill", "decode")
WORKER_STATES = ("ready", "draining")
# Load counters of WorkerInfo, each an int >= 0.
_COUNT_FIELDS = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_blocks_used",
    "kv_blocks_total",
    "kv_blocks_cached",
)


@dataclass(kw_only=True)
class WorkerInfo:
    """One worker's registry entry: identity, where to reach it, and its load at ``updated_at``."""

    id: str
    role: str  # one of WORKER_ROLES
    address: str  # host:port of its gRPC server
    host: str
    pid: int
    model: str  # model fingerprint (or name); prefill and decode must agree before KV moves
    version: str  # pdserve version
    num_requests_running: int
    num_requests_waiting: int
    kv_blocks_used: int  # held by live requests and reservations
    kv_blocks_total: int
    kv_blocks_cached: int = 0  # held only by cached prefixes or sessions
    metrics_address: str = ""  # host:port of its Prometheus endpoint, "" = none
    block_size: int = 16  # tokens per KV block (the router names prompt blocks alike for its prefix index)
    started_at: float = field(default_factory=time.time)  # unix time, s
    updated_at: float = field(default_factory=time.time)  # unix time, s, when the load was measured
    state: str = "ready"  # one of WORKER_STATES; a draining worker takes no new requests

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id or any(c.isspace() for c in self.id):
            raise ValueError(f"worker id must be a non-empty string without whitespace, got {self.id!r}")
        if self.role not in WORKER_ROLES:
            raise ValueError(f"worker role must be one of {WORKER_ROLES}, got {self.role!r}")
        if self.state not in WORKER_STATES:
            raise ValueError(f"worker state must be one of {WORKER_STATES}, got {self.state!r}")
        for name in _COUNT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"worker {name} must be an int >= 0, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict of every field (what ``pdserve status --json`` prints per worker)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerInfo:
        """Inverse of :meth:`to_dict`, tolerant across versions: unknown fields are ignored, missing
        fields with defaults take them; a missing required field or bad value raises ValueError."""
        return decode_fields(cls, data)


# Drop index members whose worker hash is gone or now holds another role. Atomic, so a worker that
# heartbeats concurrently (HSET + SADD in one MULTI) is never dropped while alive.
# KEYS[1] = index set, KEYS[2..] = worker hashes; ARGV[1] = role, ARGV[2..] = the matching member ids.
_CLEAN_INDEX_LUA = """
local removed = 0
for i = 2, #KEYS do
  if redis.call('HGET', KEYS[i], 'role') ~= ARGV[1] then
    removed = removed + redis.call('SREM', KEYS[1], ARGV[i])
  end
end
return removed
"""


class WorkerRegistry:
    """Worker entries in Redis under ``prefix`` with a ``ttl_s`` heartbeat TTL. Thread-safe; no state."""

    def __init__(self, client: redis.Redis, *, prefix: str = DEFAULT_PREFIX, ttl_s: float = 10.0) -> None:
        self._client = client
        self._prefix = check_prefix(prefix)
        self.ttl_s, self._ttl_ms = ttl_s, ttl_ms("ttl_s", ttl_s)
        self._clean_index = client.register_script(_CLEAN_INDEX_LUA)

    def _key(self, worker_id: str) -> str:
        return worker_key(worker_id, prefix=self._prefix)

    def _index(self, role: str) -> str:
        return workers_index_key(role, prefix=self._prefix)

    def _write(self, info: WorkerInfo, *, replace: bool) -> None:
        key = self._key(info.id)
        with self._client.pipeline(transaction=True) as pipe:
            if replace:
                pipe.delete(key)
            pipe.hset(key, mapping=encode_fields(info))
            pipe.pexpire(key, self._ttl_ms)
            pipe.sadd(self._index(info.role), info.id)
            pipe.execute()

    def register(self, info: WorkerInfo) -> None:
        """Publish ``info`` as a fresh entry (replacing any entry with its id) that lives ``ttl_s``."""
        self._write(info, replace=True)

    def heartbeat(self, info: WorkerInfo) -> None:
        """Refresh the entry's fields (load, state, ``updated_at``) and restart its TTL.

        Re-creates the entry if it expired or Redis lost it (restart), so a worker that was cut off
        reappears on its next beat. Idempotent.
        """
        self._write(info, replace=False)

    def deregister(self, worker_id: str) -> bool:
        """Remove the entry now (graceful shutdown); True if it was there. Idempotent."""
        with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(worker_id))
            for role in WORKER_ROLES:
                pipe.srem(self._index(role), worker_id)
            return bool(pipe.execute()[0])

    def epoch(self) -> str:
        """This Redis's registry epoch: a random id set by the first caller and kept until Redis loses its
        data (restart without persistence, flush), when the next caller sets a new one. One round trip."""
        key = registry_epoch_key(prefix=self._prefix)
        with self._client.pipeline(transaction=True) as pipe:
            pipe.set(key, uuid.uuid4().hex, nx=True)
            pipe.get(key)
            return pipe.execute()[1].decode()

    def get(self, worker_id: str) -> WorkerInfo | None:
        """The live entry, or None. ValueError if the stored entry does not decode."""
        data = self._client.hgetall(self._key(worker_id))
        return WorkerInfo.from_dict(data) if data else None

    def list_workers(self, role: str | None = None) -> list[WorkerInfo]:
        """Live workers (of ``role``, or all), sorted by id. Entries whose TTL lapsed never appear.

        Two round trips, plus one to clean the index when it held dead members. An entry that does not
        decode (e.g. from an incompatible writer) is skipped with a warning.
        """
        if role is not None and role not in WORKER_ROLES:
            raise ValueError(f"worker role must be one of {WORKER_ROLES} or None, got {role!r}")
        roles = [role] if role is not None else list(WORKER_ROLES)
        with self._client.pipeline(transaction=False) as pipe:
            for r in roles:
                pipe.smembers(self._index(r))
            members = {r: sorted(m.decode() for m in ids) for r, ids in zip(roles, pipe.execute())}
        with self._client.pipeline(transaction=False) as pipe:
            for r in roles:
                for worker_id in members[r]:
                    pipe.hgetall(self._key(worker_id))
            hashes = iter(pipe.execute())
        workers: list[WorkerInfo] = []
        for r in roles:
            stale = []
            for worker_id in members[r]:
                data = next(hashes)
                if not data or data.get(b"role", b"").decode() != r:
                    stale.append(worker_id)  # expired, or re-registered under another role
                    continue
                info = self._decode(worker_id, data)
                if info is not None:
                    workers.append(info)
            if stale:
                keys = [self._index(r), *(self._key(w) for w in stale)]
                self._clean_index(keys=keys, args=[r, *stale])
        return sorted(workers, key=lambda w: w.id)

    def _decode(self, worker_id: str, data: dict[bytes, bytes]) -> WorkerInfo | None:
        try:
            return WorkerInfo.from_dict(data)
        except ValueError as e:
            logger.warning("skipping undecodable registry entry %r: %s", self._key(worker_id), e)
            return None


class Heartbeater:
    """A daemon thread that keeps one worker's entry alive: ``registry.heartbeat(load_fn())`` every
    ``interval_s``.

    Built and started by the worker's entry point after its gRPC server listens; ``load_fn`` is called on
    the heartbeat thread and must return a fresh :class:`WorkerInfo` (current load and ``updated_at``)
    quickly and thread-safely. Redis being unreachable never stops the thread: the first failure of an
    outage is logged (once), ``connected`` turns False and ``last_error`` holds the error; beats go on at
    the same rate, and the first one that succeeds re-registers the entry (Redis may have restarted empty).
    """

    def __init__(
        self, registry: WorkerRegistry, load_fn: Callable[[], WorkerInfo], *, interval_s: float = 1.0
    ) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
        if interval_s >= registry.ttl_s:
            raise ValueError(f"interval_s ({interval_s}) must be below the registry's ttl_s ({registry.ttl_s})")
        self._registry = registry
        self._load_fn = load_fn
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._connected = False
        self._ever_connected = False
        self._last_error: BaseException | None = None

    @property
    def connected(self) -> bool:
        """True once a beat reached Redis and until one fails."""
        return self._connected

    @property
    def ever_connected(self) -> bool:
        """True once any beat reached Redis (the worker has been registered at least once)."""
        return self._ever_connected

    @property
    def last_error(self) -> BaseException | None:
        """The error of the most recent failed beat (kept after recovery; None if none ever failed)."""
        return self._last_error

    def start(self) -> None:
        """Register and start beating; the first beat runs at once. Call once (RuntimeError otherwise)."""
        if self._thread is not None:
            raise RuntimeError("Heartbeater.start() called twice")
        self._thread = threading.Thread(target=self._run, name="pdserve-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop beating and join the thread (waits at most for a beat in flight). Idempotent.

        Does not deregister: call ``registry.deregister(id)`` afterwards for a graceful exit.
        """
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("heartbeat thread still running %.1f s after stop()", timeout_s)

    def _run(self) -> None:
        needs_register = True  # at start, and after any failure: Redis may have restarted empty
        outage_logged = error_logged = False
        next_beat = time.monotonic()
        while not self._stop.is_set():
            try:
                info = self._load_fn()
                (self._registry.register if needs_register else self._registry.heartbeat)(info)
            except redis.RedisError as e:  # unreachable, timed out, or restarting (LOADING)
                self._connected, self._last_error, needs_register = False, e, True
                if not outage_logged:
                    logger.warning("heartbeat to Redis failed, retrying every %.2f s: %s", self.interval_s, e)
                    outage_logged = True
            except Exception as e:  # noqa: BLE001 - e.g. load_fn failed; the thread must outlive it
                self._last_error = e
                if not error_logged:
                    logger.exception("heartbeat failed (logged once until a beat succeeds)")
                    error_logged = True
            else:
                if outage_logged:
                    logger.warning("heartbeat to Redis succeeded again; worker %r re-registered", info.id)
                self._connected, needs_register, outage_logged, error_logged = True, False, False, False
                self._ever_connected = True
            # Fixed rate: the next beat is due interval_s after the previous one was due; if a beat overran
            # (slow Redis), the missed ones are skipped rather than fired back to back.
            now = time.monotonic()
            next_beat = max(next_beat + self.interval_s, now)
            self._stop.wait(next_beat - now)
