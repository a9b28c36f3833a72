"""Request and session records in Redis, and the one codec between dataclasses and Redis hashes.

Who calls what (all methods block for one or two Redis round trips and raise ``redis.RedisError`` when
Redis is unreachable):

- the router: :class:`RequestStore` ``create`` when a request arrives, ``update`` as it moves through
  prefill and decode (and as tokens are emitted), ``finish`` exactly once at the end; :class:`SessionStore`
  ``get`` to route a conversation's next turn to the decode worker holding its KV, ``put`` /
  ``append_tokens`` after each turn.
- ``pdserve status`` and operators: ``get``.

Lifetime: a request record lives ``ttl_s`` (default 1 h) from ``create``; ``finish`` shortens that to
``finished_ttl_s`` (default 60 s), after which Redis holds nothing of the request. ``update`` never
changes the TTL. A session lives ``ttl_s`` (default 30 min) from its last ``put`` or ``append_tokens``.

Unknown ids: ``update``, ``finish`` and ``append_tokens`` of a record that does not exist (never created,
deleted, or expired) raise ``KeyError`` naming the id and write nothing (checked atomically in Redis, so a
late writer never resurrects an expired record as a partial hash). ``get`` returns ``None``.
"""

from __future__ import annotations

import dataclasses
import struct
import time
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis

from common.state.keys import DEFAULT_PREFIX, check_prefix, request_key, session_key

T = TypeVar("T")

# ----------------------------------------------------------------------------------------- hash codec
# Field values cross into Redis as strings: str as is, int as decimal, float as repr (round-trips
# exactly), None as "". Reading coerces by the dataclass's annotations, so the same decoder serves
# Redis hashes (bytes values) and JSON dicts (typed values).


def encode_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"cannot store {type(value).__name__} value {value!r} in a Redis hash field")
    return value if isinstance(value, str) else repr(value)


def encode_fields(record: Any) -> dict[str, str]:
    """Every field of a flat dataclass as a Redis hash mapping ``{name: str}``."""
    return {f.name: encode_value(getattr(record, f.name)) for f in dataclasses.fields(record)}


def coerce_value(name: str, kind: Any, value: Any) -> Any:
    """``value`` (bytes/str from Redis, or a JSON-typed value) as the annotated type ``kind``."""
    if isinstance(value, bytes):
        value = value.decode()
    optional = isinstance(kind, types.UnionType) and type(None) in typing.get_args(kind)
    if optional:
        if value is None or value == "":
            return None
        (kind,) = [a for a in typing.get_args(kind) if a is not type(None)]
    try:
        if kind is str and isinstance(value, str):
            return value
        if kind is int and not isinstance(value, (bool, float)):
            return int(value)
        if kind is float and not isinstance(value, bool):
            return float(value)
    except (TypeError, ValueError):
        pass
    raise ValueError(f"field {name!r} must be {getattr(kind, '__name__', kind)}, got {value!r}")


def decode_fields(cls: type[T], data: Mapping[Any, Any]) -> T:
    """Build dataclass ``cls`` from ``data`` (a Redis hash or a dict; keys str or bytes).

    Unknown fields (from a newer writer) are ignored; missing fields that have defaults take them (an
    older writer); a missing required field or a value of the wrong type raises ValueError naming it.
    """
    hints = typing.get_type_hints(cls)
    values = {k.decode() if isinstance(k, bytes) else k: v for k, v in data.items()}
    kwargs, missing = {}, []
    for f in dataclasses.fields(cls):
        if f.name in values:
            kwargs[f.name] = coerce_value(f.name, hints[f.name], values[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            missing.append(f.name)
    if missing:
        raise ValueError(f"{cls.__name__} is missing required field(s) {missing}")
    return cls(**kwargs)


def ttl_ms(name: str, ttl_s: float) -> int:
    """A TTL in seconds as PEXPIRE milliseconds (at least 1); ValueError unless 0 < ttl_s < inf."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s < float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {ttl_s!r}")
    return max(1, round(ttl_s * 1000))


# Create a hash only if absent. KEYS[1] = key; ARGV = ttl_ms, field, value, field, value, ...
_CREATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""
# Set fields of a hash only if it exists; ARGV[1] = new TTL in ms, or "" to keep the TTL.
_UPDATE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
if ARGV[1] ~= '' then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return 1
"""


def _flatten(mapping: Mapping[str, str]) -> list[str]:
    return [x for kv in mapping.items() for x in kv]


# ----------------------------------------------------------------------------------------- requests
REQUEST_STATUSES = ("queued", "prefilling", "decoding", "finished", "failed", "aborted")
TERMINAL_STATUSES = ("finished", "failed", "aborted")


@dataclass(kw_only=True)
class RequestRecord:
    """What Redis knows of one request: its phase, the workers chosen for it and why, its progress."""

    request_id: str
    status: str  # one of REQUEST_STATUSES
    prefill_worker_id: str = ""
    decode_worker_id: str = ""
    num_prompt_tokens: int = 0
    num_tokens_emitted: int = 0
    deadline_s: float | None = None  # absolute unix time, None = no deadline
    created_at: float = field(default_factory=time.time)  # unix time, s
    updated_at: float = field(default_factory=time.time)  # unix time, s
    finish_reason: str = ""
    error: str = ""
    route_reason: str = ""  # why the router chose these workers
    trace_id: str = ""  # OpenTelemetry trace id (32 hex) of the request, "" = none
    num_migrations: int = 0  # times it moved to another decode worker mid-stream
    # Stage times, unix s, 0.0 = not reached (``created_at`` is when the router received it); `pdserve trace`.
    routed_at: float = 0.0  # KV reserved on the decode worker, prefill worker chosen
    queued_at: float = 0.0  # joined the prefill worker's engine queue
    prefill_started_at: float = 0.0  # first scheduled on the prefill worker
    prefill_finished_at: float = 0.0  # first token sampled on the prefill worker
    kv_transfer_started_at: float = 0.0  # first KV chunk queued by the prefill worker
    kv_transfer_finished_at: float = 0.0  # the decode worker acknowledged the whole KV
    first_token_at: float = 0.0  # first token sent to the client
    decode_started_at: float = 0.0  # the router asked the decode worker to continue
    last_token_at: float = 0.0  # last token sent to the client

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if self.status not in REQUEST_STATUSES:
            raise ValueError(f"request status must be one of {REQUEST_STATUSES}, got {self.status!r}")


class RequestStore:
    """Request records as Redis hashes (see :mod:`common.state.keys`). Thread-safe; holds no state."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl_s: float = 3600.0,
        finished_ttl_s: float = 60.0,
    ) -> None:
        self._client = client
        self._prefix = check_prefix(prefix)
        self.ttl_s, self._ttl_ms = ttl_s, ttl_ms("ttl_s", ttl_s)
        self.finished_ttl_s, self._finished_ttl_ms = finished_ttl_s, ttl_ms("finished_ttl_s", finished_ttl_s)
        self._create = client.register_script(_CREATE_LUA)
        self._update = client.register_script(_UPDATE_LUA)

    def _key(self, request_id: str) -> str:
        return request_key(request_id, prefix=self._prefix)

    def create(self, record: RequestRecord) -> None:
        """Store a new record with the active TTL; ValueError if a record with that id already exists."""
        key = self._key(record.request_id)
        if not self._create(keys=[key], args=[self._ttl_ms, *_flatten(encode_fields(record))]):
            raise ValueError(f"request record {record.request_id!r} already exists")

    def update(self, request_id: str, /, **fields: Any) -> None:
        """Set only ``fields`` (HSET of those fields; ``updated_at`` defaults to now). Keeps the TTL.

        Field names and values are validated (ValueError naming them); a terminal status must go through
        :meth:`finish`, which also shortens the TTL. KeyError if the record does not exist.
        """
        hints = typing.get_type_hints(RequestRecord)
        for name, value in fields.items():
            if name not in hints or name == "request_id":
                raise ValueError(f"cannot update request field {name!r}; fields are {sorted(hints)}")
            coerce_value(name, hints[name], value)
        if "status" in fields:
            status = fields["status"]
            if status not in REQUEST_STATUSES:
                raise ValueError(f"request status must be one of {REQUEST_STATUSES}, got {status!r}")
            if status in TERMINAL_STATUSES:
                raise ValueError(f"status {status!r} is terminal: call finish(), which also shortens the TTL")
        fields.setdefault("updated_at", time.time())
        mapping = {name: encode_value(value) for name, value in fields.items()}
        if not self._update(keys=[self._key(request_id)], args=["", *_flatten(mapping)]):
            raise KeyError(f"no request record {request_id!r} (never created, deleted or expired)")

    def finish(self, request_id: str, status: str, finish_reason: str = "", error: str = "") -> None:
        """Record the terminal ``status`` and cut the TTL to ``finished_ttl_s``. KeyError if unknown.

        Called once per request by the router; calling it again overwrites the status and restarts the
        short TTL (last write wins).
        """
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"finish status must be one of {TERMINAL_STATUSES}, got {status!r}")
        for name, value in (("finish_reason", finish_reason), ("error", error)):
            coerce_value(name, str, value)
        mapping = {"status": status, "finish_reason": finish_reason, "error": error}
        mapping["updated_at"] = repr(time.time())
        if not self._update(keys=[self._key(request_id)], args=[self._finished_ttl_ms, *_flatten(mapping)]):
            raise KeyError(f"no request record {request_id!r} (never created, deleted or expired)")

    def get(self, request_id: str) -> RequestRecord | None:
        """The record, or None if there is none. ValueError if the stored hash does not decode."""
        data = self._client.hgetall(self._key(request_id))
        return decode_fields(RequestRecord, data) if data else None

    def delete(self, request_id: str) -> bool:
        """Remove the record; True if there was one. Idempotent."""
        return bool(self._client.delete(self._key(request_id)))


# ----------------------------------------------------------------------------------------- sessions
_TOKEN_STRUCT_CODE = "<{}I"  # little-endian uint32, 4 bytes per token id
MAX_TOKEN_ID = 2**32 - 1


def pack_token_ids(token_ids: list[int]) -> bytes:
    """Token ids as little-endian uint32 bytes; ValueError naming the first id outside [0, 2**32)."""
    for i, t in enumerate(token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"token id at index {i} must be an int in [0, {MAX_TOKEN_ID}], got {t!r}")
    return struct.pack(_TOKEN_STRUCT_CODE.format(len(token_ids)), *token_ids)


def unpack_token_ids(data: bytes) -> list[int]:
    if len(data) % 4:
        raise ValueError(f"packed token ids must be a multiple of 4 bytes, got {len(data)}")
    return list(struct.unpack(_TOKEN_STRUCT_CODE.format(len(data) // 4), data))


@dataclass(kw_only=True)
class SessionRecord:
    """A conversation: its token history and the decode worker that holds its KV ("" = none)."""

    session_id: str
    token_ids: list[int]
    decode_worker_id: str = ""
    updated_at: float = field(default_factory=time.time)  # unix time, s


# Append packed token ids to a session. KEYS[1] = key; ARGV = packed ids, updated_at, ttl_ms.
# Returns the new number of tokens, or -1 if the session does not exist.
_APPEND_LUA = """
local old = redis.call('HGET', KEYS[1], 'token_ids')
if not old then return -1 end
local new = old .. ARGV[1]
redis.call('HSET', KEYS[1], 'token_ids', new, 'updated_at', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return #new / 4
"""


class SessionStore:
    """Session records as Redis hashes (see :mod:`common.state.keys`). Thread-safe; holds no state."""

    def __init__(self, client: redis.Redis, *, prefix: str = DEFAULT_PREFIX, ttl_s: float = 1800.0) -> None:
        self._client = client
        self._prefix = check_prefix(prefix)
        self.ttl_s, self._ttl_ms = ttl_s, ttl_ms("ttl_s", ttl_s)
        self._append = client.register_script(_APPEND_LUA)

    def _key(self, session_id: str) -> str:
        return session_key(session_id, prefix=self._prefix)

    def put(self, record: SessionRecord) -> None:
        """Store the whole record, replacing any previous one, and restart its TTL. Idempotent."""
        key = self._key(record.session_id)
        mapping = {
            "session_id": record.session_id,
            "decode_worker_id": record.decode_worker_id,
            "updated_at": encode_value(float(record.updated_at)),
            "token_ids": pack_token_ids(record.token_ids),
        }
        with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(key).hset(key, mapping=mapping).pexpire(key, self._ttl_ms).execute()

    def append_tokens(self, session_id: str, token_ids: list[int]) -> int:
        """Append ``token_ids`` atomically, set ``updated_at`` to now, restart the TTL; return the new
        number of tokens. KeyError if the session does not exist."""
        packed = pack_token_ids(token_ids)
        n = self._append(keys=[self._key(session_id)], args=[packed, repr(time.time()), self._ttl_ms])
        if n < 0:
            raise KeyError(f"no session {session_id!r} (never stored, deleted or expired)")
        return int(n)

    def get(self, session_id: str) -> SessionRecord | None:
        """The record, or None if there is none."""
        data = self._client.hgetall(self._key(session_id))
        if not data:
            return None
        return SessionRecord(
            session_id=session_id,
            token_ids=unpack_token_ids(data[b"token_ids"]),
            decode_worker_id=data.get(b"decode_worker_id", b"").decode(),
            updated_at=float(data[b"updated_at"]),
        )

    def delete(self, session_id: str) -> bool:
        """Remove the session; True if there was one. Idempotent."""
        return bool(self._client.delete(self._key(session_id)))
