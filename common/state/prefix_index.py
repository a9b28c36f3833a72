"""The router's prefix index in Redis: which block names each worker's prefix cache holds.

Workers publish what their block pool named and evicted since the last publish (:class:`PrefixPublisher`,
on the worker's periodic tick); the router asks, for a prompt's block names, how long a leading run each
candidate holds (:meth:`PrefixIndex.overlap`), and weighs that against load. The index lags the caches by
up to a tick and may name an evicted block: a wrong guess costs only the recompute a miss costs anyway.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import redis

from common.state.keys import DEFAULT_PREFIX, check_prefix, prefix_index_key

MAX_PUBLISH = 50_000  # names per publish (the rest goes on the next tick)


class PrefixIndex:
    def __init__(self, client: redis.Redis, *, prefix: str = DEFAULT_PREFIX, ttl_s: float = 10.0) -> None:
        self._client = client
        self._prefix = check_prefix(prefix)
        self.ttl_ms = max(1, round(ttl_s * 1000))

    def publish(self, worker_id: str, added: Sequence[bytes], removed: Sequence[bytes]) -> None:
        """Apply one worker's changes and restart the set's TTL (a dead worker's index expires with it)."""
        key = prefix_index_key(worker_id, prefix=self._prefix)
        pipe = self._client.pipeline(transaction=False)
        if removed:
            pipe.srem(key, *removed)
        if added:
            pipe.sadd(key, *added)
        pipe.pexpire(key, self.ttl_ms)
        pipe.execute()

    def overlap(self, worker_ids: Sequence[str], names: Sequence[bytes]) -> dict[str, int]:
        """For each worker, how many of ``names`` from the first on it holds in a row (one round trip)."""
        if not names or not worker_ids:
            return {w: 0 for w in worker_ids}
        pipe = self._client.pipeline(transaction=False)
        for w in worker_ids:
            pipe.smismember(prefix_index_key(w, prefix=self._prefix), list(names))
        out = {}
        for w, held in zip(worker_ids, pipe.execute()):
            n = 0
            while n < len(held) and held[n]:
                n += 1
            out[w] = n
        return out


class PrefixPublisher:
    """Drains a block pool's name events into the index; call :meth:`flush` periodically (one thread)."""

    def __init__(self, index: PrefixIndex, worker_id: str, events: deque) -> None:
        self.index, self.worker_id, self._events = index, worker_id, events

    def flush(self) -> None:
        """Publish what changed (the last event of a name wins). Raises the Redis error, events kept."""
        state: dict[bytes, bool] = {}
        taken = []
        while self._events and len(taken) < MAX_PUBLISH:
            event = self._events.popleft()
            taken.append(event)
            state[event[0]] = event[1]
        try:
            self.index.publish(self.worker_id, [n for n, held in state.items() if held],
                               [n for n, held in state.items() if not held])
        except redis.RedisError:
            self._events.extendleft(reversed(taken))  # try again next tick, in order
            raise
