"""Which workers serve a request: decode first (it must hold the KV), then prefill.

Scores combine the registry's load (refreshed about once a second, so stale within a burst) with the
requests this router has in flight on each worker (exact and immediate), so that a burst spreads over the
pool instead of piling onto the worker that looked idlest a second ago.

- decode: fewest requests (running + waiting + this router's in flight), then most free KV blocks;
- prefill: fewest queued plus running requests, counting this router's in-flight prefills;
- ties go to the worker this router sent the fewest requests so far (round robin when the pool is idle).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from common.state.registry import WorkerInfo


@dataclass(frozen=True)
class Choice:
    worker: WorkerInfo
    reason: str


class LoadTracker:
    """This router's in-flight requests per worker, and how many it ever sent each (thread-safe)."""

    def __init__(self) -> None:
        self._inflight: Counter[str] = Counter()
        self._assigned: Counter[str] = Counter()
        self._lock = threading.Lock()

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
        """Requests ever sent to the worker: the tie-break between equally loaded workers (round robin)."""
        return self._assigned.get(worker_id, 0)


def pick_decode(workers: list[WorkerInfo], tracker: LoadTracker, exclude: set[str]) -> Choice | None:
    candidates = [w for w in workers if w.role == "decode" and w.id not in exclude]
    if not candidates:
        return None

    def score(w: WorkerInfo) -> tuple:
        free = w.kv_blocks_total - w.kv_blocks_used
        load = tracker.get(w.id) + w.num_requests_running + w.num_requests_waiting
        return (load, -free, tracker.assigned(w.id), w.id)

    best = min(candidates, key=score)
    free = best.kv_blocks_total - best.kv_blocks_used
    return Choice(best, f"decode {best.id}: least loaded of {len(candidates)} ({free} free blocks)")


def pick_prefill(workers: list[WorkerInfo], tracker: LoadTracker, exclude: set[str]) -> Choice | None:
    candidates = [w for w in workers if w.role == "prefill" and w.id not in exclude]
    if not candidates:
        return None
    def score(w: WorkerInfo) -> tuple:
        return (tracker.get(w.id) + w.num_requests_waiting + w.num_requests_running, tracker.assigned(w.id), w.id)

    best = min(candidates, key=score)
    return Choice(best, f"prefill {best.id}: shortest queue of {len(candidates)}")
