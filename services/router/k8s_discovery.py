"""The router's second opinion on its workers: the EndpointSlices of the prefill and decode headless Services.

On when ``--k8s-prefill-service`` or ``--k8s-decode-service`` names a Service (:meth:`K8sDiscovery.from_config`;
None when neither does, and the router routes on the Redis registry alone, as without this module).

How it combines with the Redis registry, which stays the source of addresses, load figures and the KV identity
and model fingerprint a hand-off needs:

1. A background thread lists the watched Services' EndpointSlices every ``--k8s-refresh-s`` (2 s) and keeps the
   latest snapshot. A list, not a watch: one small request per pool, nothing to resume after a dropped stream
   or an expired resource version, and a thread that stops promptly; a 2 s lag is below the registry's own
   heartbeat TTL, and a terminating worker refuses new requests by itself meanwhile (it drains).
2. :meth:`K8sDiscovery.routable` is :class:`~services.router.registry_view.RegistryView`'s filter: a registry
   worker of a watched role whose pod (matched by worker id == pod name, else by IP:port: the rule of
   :class:`common.cluster.k8s.EndpointIndex`) the EndpointSlices show ``not_ready`` or ``terminating`` gets no
   new requests. A worker of an unwatched role, or matched to no endpoint (the slices lag a new pod by a
   moment; a worker outside the cluster), keeps routing: the EndpointSlices can only take workers away.
3. A pod ready in the EndpointSlices but absent from the registry is reported (logged when the set changes,
   and listed in ``/healthz`` and ``/readyz`` as ``k8s_unregistered``), never routed to: an address alone
   lacks the identity the registry carries.
4. When a list fails (API server unreachable, RBAC refusing, a timeout), the snapshot is dropped and the router
   routes on the registry alone until a list succeeds again: logged once per outage, never an error to a
   client. A Service without EndpointSlices (misnamed?) is logged once and vetoes nothing. No usable
   Kubernetes configuration at start (no kubeconfig, not in a pod) is logged as an error, and the router runs
   without discovery.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from common.cluster.k8s import EndpointIndex, K8sError, K8sReader, PodEndpoint
from common.state.registry import WORKER_ROLES, WorkerInfo
from services.router.config import RouterConfig

log = logging.getLogger(__name__)


class K8sDiscovery:
    """Lists the EndpointSlices of ``services`` (role → Service name) through ``reader``; see the module."""

    def __init__(self, reader: K8sReader, services: Mapping[str, str], *, refresh_s: float = 2.0) -> None:
        unknown = sorted(set(services) - set(WORKER_ROLES))
        if unknown or not services:
            raise ValueError(f"services must map some of {WORKER_ROLES} to Service names, got {dict(services)!r}")
        if isinstance(refresh_s, bool) or not isinstance(refresh_s, (int, float)) or not refresh_s > 0:
            raise ValueError(f"k8s refresh_s must be a positive number of seconds, got {refresh_s!r}")
        self.reader = reader
        self.services = dict(services)
        self.refresh_s = refresh_s
        # role -> the pool's endpoints and their index; None: no snapshot (not read yet, or the API failed)
        self._pools: dict[str, tuple[tuple[PodEndpoint, ...], EndpointIndex]] | None = None
        self._registered: Callable[[], list[WorkerInfo]] = list
        self._unregistered: list[str] = []  # "role/pod" of ready endpoints without a registry entry
        self._empty_logged: set[str] = set()
        self._outage_logged = False
        self.up = False  # the last list succeeded
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k8s-discovery", daemon=True)

    @classmethod
    def from_config(cls, config: RouterConfig) -> K8sDiscovery | None:
        """Built from the ``--k8s-*`` settings; None when no Service is named, and None with an error logged
        when no Kubernetes configuration is usable (no kubeconfig, not in a pod): the router then routes on the
        registry alone rather than not at all. ValueError for a bad ``--k8s-refresh-s``."""
        services = {role: name for role, name in (("prefill", config.k8s_prefill_service),
                                                  ("decode", config.k8s_decode_service)) if name}  # fmt: skip
        if not services:
            return None
        try:
            reader = K8sReader.connect(namespace=config.k8s_namespace, kubeconfig=config.k8s_kubeconfig)
        except K8sError as e:
            log.error("Kubernetes discovery off, routing on the Redis registry alone: %s", e)
            return None
        try:
            return cls(reader, services, refresh_s=config.k8s_refresh_s)
        except ValueError:
            reader.close()
            raise

    def start(self, registered: Callable[[], list[WorkerInfo]]) -> K8sDiscovery:
        """List once now, then every ``refresh_s`` on a daemon thread. ``registered`` (the registry view's
        ``all_workers``) is what unregistered pods are reported against. Call once."""
        self._registered = registered
        log.info("Kubernetes discovery on: %s in namespace %r at %s, listed every %.1f s",
                 ", ".join(f"{r} Service {s!r}" for r, s in self.services.items()), self.reader.namespace,
                 self.reader.server, self.refresh_s)  # fmt: skip
        self.refresh()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10.0)
        self.reader.close()

    def routable(self, worker: WorkerInfo) -> bool:
        """False when the latest snapshot shows ``worker``'s pod not ready or terminating; True otherwise
        (no snapshot, an unwatched role, no matching endpoint). Thread-safe, no I/O: one snapshot read."""
        pools = self._pools
        if pools is None or worker.role not in pools:
            return True
        found = pools[worker.role][1].find(worker.id, worker.address)
        return found is None or found.state == "ready"

    def details(self) -> dict:
        """For ``/healthz`` and ``/readyz``: ``k8s`` ("ok" or "unreachable"), ``k8s_excluded`` (registry workers
        the EndpointSlices take away) and ``k8s_unregistered`` (ready pods without a registry entry)."""
        excluded = sorted(w.id for w in self._registered() if not self.routable(w))
        return {"k8s": "ok" if self.up else "unreachable", "k8s_excluded": excluded,
                "k8s_unregistered": list(self._unregistered)}  # fmt: skip

    def refresh(self) -> bool:
        """List every watched Service's EndpointSlices now; False (and no snapshot: registry alone) on failure."""
        try:
            pools = {role: self.reader.service_endpoints(service) for role, service in self.services.items()}
        except K8sError as e:
            if not self._outage_logged:
                log.warning("Kubernetes discovery failed; routing on the Redis registry alone until it answers: %s", e)
                self._outage_logged = True
            self.up, self._pools = False, None
            return False
        if self._outage_logged:
            log.warning("Kubernetes discovery answers again")
            self._outage_logged = False
        for role, found in pools.items():
            if found.num_slices == 0 and role not in self._empty_logged:
                self._empty_logged.add(role)
                log.warning("no EndpointSlices for the %s Service %r in namespace %r (misnamed, or no selector?): "
                            "it takes no %s worker away", role, found.service, found.namespace, role)
        self._pools = {role: (found.endpoints, EndpointIndex(found.endpoints)) for role, found in pools.items()}
        self.up = True
        self._report_unregistered()
        return True

    def _report_unregistered(self) -> None:
        try:
            registered = self._registered()
        except Exception:  # noqa: BLE001 - a report must not stop discovery
            log.exception("cannot read the registry view for the unregistered-pod report")
            return
        pools = self._pools or {}
        unregistered = []
        for role, (endpoints, index) in pools.items():
            matched = {index.find(w.id, w.address) for w in registered if w.role == role}
            unregistered += [f"{role}/{e.pod or ','.join(e.addresses)}" for e in endpoints
                             if e.state == "ready" and e not in matched]  # fmt: skip
        if unregistered != self._unregistered and unregistered:
            log.info("ready in the EndpointSlices but not in the registry (not routed to until they register): %s",
                     ", ".join(unregistered))
        self._unregistered = unregistered

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self.refresh()
