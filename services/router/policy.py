"""Which workers serve a request: decode first (it must hold the KV), then prefill.

The router's own bookkeeping is exact and immediate; the registry's load figures are up to a heartbeat
(about a second) old, so a burst would pile onto whichever worker looked idlest a second ago, and a worker
whose last heartbeat caught a request that has long finished would look busy. So, per pool:

0. not a suspect: a worker that just failed a call as if dead (unreachable, hung) is tried last for a cool-down
   (its registry entry lives on until its heartbeat lapses, and every request would otherwise spend its
   retry on it); then not a suspect pair: a prefill and a decode worker whose hand-off failed while both still
   answered the router (the prefill worker's answer: its KV did not reach the decode worker; a network split
   between their hosts, say) are paired last for a longer cool-down, so
   the requests after the first go through another pair without paying the failure again: the decode worker
   goes last when every prefill worker it could pair with is a suspect pair with it, the prefill worker when
   the decode worker already chosen is;
1. fewest requests this router has in flight there (a slow worker accumulates them: it gets fewer new ones);
2. then the fewest requests this router ever sent there (round robin over an idle pool);
3. then the registry's view: for decode, fewest running + waiting requests and most free KV blocks; for
   prefill, the shortest queue (this is what tells one router about the others' traffic);
4. then the id, so that the choice is deterministic.

A decode worker that turns out to have no room answers ReserveKv with RESOURCE_EXHAUSTED, and the router
tries the next one.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from common.state.registry import WorkerInfo


@dataclass(frozen=True)
class Choice:
    worker: WorkerInfo
    reason: str


class LoadTracker:
    """This router's in-flight requests per worker, how many it ever sent each, and which workers and which
    (prefill, decode) pairs are suspects (thread-safe). ``cooldown_s``: how long a suspect worker stays one;
    ``pair_cooldown_s``: a suspect pair."""

    def __init__(self, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 pair_cooldown_s: float = 30.0) -> None:  # fmt: skip
        self._inflight: Counter[str] = Counter()
        self._assigned: Counter[str] = Counter()
        self._suspect_until_s: dict[str, float] = {}
        self._pair_until_s: dict[tuple[str, str], float] = {}
        self.cooldown_s = cooldown_s
        self.pair_cooldown_s = pair_cooldown_s
        self._clock = clock
        self._lock = threading.Lock()

    def suspect_pair(self, prefill_id: str, decode_id: str) -> None:
        """A hand-off from ``prefill_id`` to ``decode_id`` failed while both answered: pair them last for the
        next ``pair_cooldown_s``."""
        with self._lock:
            now = self._clock()
            for pair in [pair for pair, until in self._pair_until_s.items() if until <= now]:
                del self._pair_until_s[pair]  # the table stays as small as the suspect pairs
            self._pair_until_s[(prefill_id, decode_id)] = now + self.pair_cooldown_s

    def is_suspect_pair(self, prefill_id: str, decode_id: str) -> bool:
        until = self._pair_until_s.get((prefill_id, decode_id))
        return until is not None and self._clock() < until

    def suspect(self, worker_id: str) -> None:
        """``worker_id`` failed a call as if dead: try it last for the next ``cooldown_s``."""
        with self._lock:
            self._suspect_until_s[worker_id] = self._clock() + self.cooldown_s

    def is_suspect(self, worker_id: str) -> bool:
        until = self._suspect_until_s.get(worker_id)
        if until is None:
            return False
        if self._clock() < until:
            return True
        with self._lock:
            if self._suspect_until_s.get(worker_id) == until:
                del self._suspect_until_s[worker_id]
        return False

    def acquire(self, worker_id: str) -> None:
        with self._lock:
            self._inflight[worker_id] += 1
            self._assigned[worker_id] += 1

    def release(self, worker_id: str) -> None:
        with self._lock:
            self._inflight[worker_id] -= 1
            if self._inflight[worker_id] <= 0:
                del self._inflight[worker_id]

    def get(self, worker_id: str) -> int:
        return self._inflight.get(worker_id, 0)

    def assigned(self, worker_id: str) -> int:
        return self._assigned.get(worker_id, 0)


def pick_decode(workers: list[WorkerInfo], tracker: LoadTracker, exclude: set[str],
                via_prefill: bool = False) -> Choice | None:  # fmt: skip
    """``via_prefill``: the KV will come from one of the prefill workers in ``workers`` (not excluded); a decode
    worker that is a suspect pair with every one of them goes last."""
    candidates = [w for w in workers if w.role == "decode" and w.id not in exclude]
    if not candidates:
        return None
    prefills = [w.id for w in workers if w.role == "prefill" and w.id not in exclude] if via_prefill else []

    def cut_off(d: WorkerInfo) -> bool:
        return bool(prefills) and all(tracker.is_suspect_pair(p, d.id) for p in prefills)

    def score(w: WorkerInfo) -> tuple:
        registry_load = w.num_requests_running + w.num_requests_waiting
        free = w.kv_blocks_total - w.kv_blocks_used
        return (tracker.is_suspect(w.id), cut_off(w), tracker.get(w.id), tracker.assigned(w.id), registry_load,
                -free, w.id)  # fmt: skip

    best = min(candidates, key=score)
    return Choice(best, f"decode {best.id}: {tracker.get(best.id)} in flight here, of {len(candidates)} candidates")


def pick_prefill(workers: list[WorkerInfo], tracker: LoadTracker, exclude: set[str],
                 decode_id: str = "") -> Choice | None:  # fmt: skip
    """``decode_id``: the decode worker the KV goes to (a suspect pair with it goes last)."""
    candidates = [w for w in workers if w.role == "prefill" and w.id not in exclude]
    if not candidates:
        return None

    def score(w: WorkerInfo) -> tuple:
        registry_load = w.num_requests_waiting + w.num_requests_running
        return (tracker.is_suspect(w.id), tracker.is_suspect_pair(w.id, decode_id), tracker.get(w.id),
                tracker.assigned(w.id), registry_load, w.id)  # fmt: skip

    best = min(candidates, key=score)
    return Choice(best, f"prefill {best.id}: {tracker.get(best.id)} in flight here, of {len(candidates)} candidates")


def pick_prefill_cached(
    workers: list[WorkerInfo], tracker: LoadTracker, exclude: set[str], cached_tokens: dict[str, int],
    num_prompt: int, load_penalty_tokens: int, decode_id: str = "",
) -> Choice | None:
    """Cache-aware: the prefill worker that saves the most prompt compute, net of its load.

    Score = prompt tokens cached there (``cached_tokens``, from the prefix index) − ``load_penalty_tokens`` ×
    (requests in flight from this router + waiting in its queue): one queued request is worth recomputing
    that many tokens. Without a cached token anywhere this is :func:`pick_prefill`.
    """
    candidates = [w for w in workers if w.role == "prefill" and w.id not in exclude]
    if not candidates or not any(cached_tokens.get(w.id, 0) for w in candidates):
        return pick_prefill(workers, tracker, exclude, decode_id)

    def load(w: WorkerInfo) -> int:
        return tracker.get(w.id) + w.num_requests_waiting

    def score(w: WorkerInfo) -> tuple:
        return (not tracker.is_suspect(w.id), not tracker.is_suspect_pair(w.id, decode_id),
                cached_tokens.get(w.id, 0) - load_penalty_tokens * load(w),
                -tracker.assigned(w.id), w.id)

    best = max(candidates, key=score)
    return Choice(best, f"prefill {best.id}: {cached_tokens.get(best.id, 0)} of {num_prompt} prompt tokens cached "
                        f"there, {load(best)} queued or in flight, of {len(candidates)} candidates")
