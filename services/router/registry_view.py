"""The router's view of the live workers: re-read from Redis in the background, kept when Redis is away.

When Redis is unreachable the router keeps serving from the last view it had (``degraded`` turns True and
the view's age grows) instead of failing every request; a worker whose heartbeat lapsed disappears from the
next successful read. When Redis comes back, or comes back empty (restarted without persistence, flushed:
its registry epoch changed), the workers missing from it are kept for ``grace_s`` while they re-register at
their next heartbeat, instead of the router seeing an empty cluster for that second.

An optional ``routable`` filter (the router's Kubernetes discovery, :mod:`services.router.k8s_discovery`) takes
workers away from :meth:`RegistryView.workers` at each call; without one the view is the registry's alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from common.state.registry import WorkerInfo, WorkerRegistry

log = logging.getLogger(__name__)


class RegistryView:
    def __init__(self, registry: WorkerRegistry, *, refresh_s: float = 0.5, grace_s: float = 5.0,
                 routable: Callable[[WorkerInfo], bool] | None = None) -> None:
        """``routable``: called for every ready worker on every :meth:`workers` call (on request threads), so
        it must be thread-safe, quick and free of I/O; False keeps that worker from new requests."""
        self.registry = registry
        self.routable = routable
        self.refresh_s = refresh_s
        self.grace_s = grace_s
        self._epoch: str | None = None
        self._grace_until_s = 0.0  # monotonic; until then, workers missing from a read are kept
        self._workers: list[WorkerInfo] = []  # ready ones: what requests may go to
        self._all: list[WorkerInfo] = []  # every live entry, draining ones too (for metrics)
        self.updated_at_s = 0.0  # monotonic time of the last successful read
        self.degraded = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-view", daemon=True)

    def start(self) -> RegistryView:
        self.refresh()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def workers(self, role: str | None = None) -> list[WorkerInfo]:
        """The ready workers (of ``role``), as of the last successful read, that ``routable`` (if any) admits now."""
        routable = self.routable
        return [w for w in self._workers if (role is None or w.role == role) and (routable is None or routable(w))]

    def all_workers(self) -> list[WorkerInfo]:
        """Every live registry entry, ready or draining, as of the last successful read."""
        return list(self._all)

    def refresh(self) -> bool:
        """Re-read the registry now; False (and the old view kept) if Redis did not answer."""
        try:
            workers = self.registry.list_workers()
            epoch = self.registry.epoch()
        except Exception as exc:  # noqa: BLE001 - any Redis failure: keep the last view
            if not self.degraded:
                n = len(self._workers)
                log.warning("registry unreachable (%s); serving from the last view of %d workers", exc, n)
            self.degraded = True
            return False
        now = time.monotonic()
        restarted = self._epoch is not None and epoch != self._epoch
        if self.degraded or restarted:
            self._grace_until_s = now + self.grace_s
            log.info("registry reachable again%s: %d workers; keeping the missing ones %.1f s while they re-register",
                     " (Redis lost its data)" if restarted else "", len(workers), self.grace_s)
        self._epoch = epoch
        if now < self._grace_until_s:
            listed = {w.id for w in workers}
            workers = [*workers, *(w for w in self._all if w.id not in listed)]
        self._all = list(workers)
        self._workers = [w for w in workers if w.state == "ready"]
        self.updated_at_s = now
        self.degraded = False
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()
